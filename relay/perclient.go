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

// The bounds kept per client.
type (
	// ipSlots: live subscriptions. Each connection bounds its own (MaxSubscriptions), but a client
	// may open MaxConnsPerIP connections, and every subscription keeps a de-duplication window of
	// up to 1,024 ids (about 51 KiB once full): 32,000 of them from one address would be 1.6 GiB.
	ipSlots = perClient[int]
	// ipCounts: entries waiting in its connections' inboxes.
	ipCounts = perClient[int]
	// ipBytes: bytes of the shared initial-result budget. The per-connection share alone let eight
	// slow readers of one client hold the whole budget, and every other client's REQ was refused busy.
	ipBytes = perClient[int64]
)
