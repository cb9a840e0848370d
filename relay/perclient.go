package relay

import "sync"

// perClient counts what each client (limitKey) holds of something bounded across its connections:
// live subscriptions (ipSlots), inbox entries (ipCounts), initial-answer bytes (ipBytes). An entry
// goes when it drops to zero, so the map holds only clients that hold something.
type perClient[T int | int64] struct {
	mu    sync.Mutex
	limit T
	held  map[string]T
}

func newPerClient[T int | int64](limit T) *perClient[T] {
	return &perClient[T]{limit: limit, held: map[string]T{}}
}

// take adds n to key's count unless that would pass the limit (force: add anyway).
func (c *perClient[T]) take(key string, n T, force bool) bool {
	if n == 0 {
		return true // no entry for nothing: give(0) would never remove it
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !force && c.held[key]+n > c.limit {
		return false
	}
	c.held[key] += n
	return true
}

// give takes n back from key's count.
func (c *perClient[T]) give(key string, n T) {
	if n == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held[key] -= n; c.held[key] <= 0 {
		delete(c.held, key)
	}
}

// The three bounds, each a perClient (their uses say why each exists).
type (
	ipSlots  = perClient[int]
	ipCounts = perClient[int]
	ipBytes  = perClient[int64]
)
