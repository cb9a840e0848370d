package relay

import (
	"sync"
	"time"
)

// recentEphemeral remembers the ephemeral events this process accepted lately. accept_event
// stores nothing for them, so it cannot answer "duplicate:": a client that sends one again (a
// retry after a reconnect) would have it fanned out a second time, and only the subscriptions' own
// windows would stop a second delivery. Bounded by age and count; a copy sent to another process
// is that process's to judge (and the windows' to catch).
type recentEphemeral struct {
	mu   sync.Mutex
	at   map[idKey]time.Time
	ring []idKey // FIFO of at's keys, for the count bound
	next int
}

const (
	ephemeralDedupeTTL = time.Minute
	ephemeralDedupeMax = 65536
)

// seen reports whether id was accepted here within the TTL.
func (r *recentEphemeral) seen(id idKey, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	t, ok := r.at[id]
	return ok && now.Sub(t) < ephemeralDedupeTTL
}

// add records id as accepted at now.
func (r *recentEphemeral) add(id idKey, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.at == nil {
		r.at = make(map[idKey]time.Time)
	}
	if _, ok := r.at[id]; ok {
		r.at[id] = now
		return
	}
	if len(r.ring) < ephemeralDedupeMax {
		r.ring = append(r.ring, id)
	} else {
		delete(r.at, r.ring[r.next])
		r.ring[r.next] = id
		r.next = (r.next + 1) % ephemeralDedupeMax
	}
	r.at[id] = now
}
