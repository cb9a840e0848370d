package listener

// recentKeys remembers the last n keys (FIFO eviction). The LSN check already drops whole
// transactions we have handled; this catches what the LSN cannot: a transaction whose first rows
// were delivered before the stream broke mid-transaction and which the server then sends again
// in full. n bounds memory; anything older than n deliveries is also older than our LSN.
type recentKeys struct {
	ring []string
	next int
	set  map[string]struct{}
}

func newRecentKeys(n int) *recentKeys {
	return &recentKeys{ring: make([]string, n), set: make(map[string]struct{}, n)}
}

// add records key and reports whether it was new.
func (r *recentKeys) add(key string) bool {
	if _, ok := r.set[key]; ok {
		return false
	}
	if old := r.ring[r.next]; old != "" {
		delete(r.set, old)
	}
	r.ring[r.next] = key
	r.next = (r.next + 1) % len(r.ring)
	r.set[key] = struct{}{}
	return true
}
