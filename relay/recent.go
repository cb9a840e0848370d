package relay

import (
	"sync"
	"time"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// recentStored keeps the stored events Deliver was handed lately. PostgreSQL writes a commit to
// the WAL, which logical decoding reads, before the commit is visible to other sessions (with
// synchronous replication, a standby round trip before). So an event can reach Deliver before a
// REQ registers and still be missing from that REQ's initial query. A REQ takes the kept events
// its filters match as it registers, and sends those its query's snapshot did not see. Bounded by
// count, bytes and age: the gap is a commit's last steps, or a synchronous standby's reply.
type recentStored struct {
	mu    sync.Mutex
	ring  []recentEntry // circular, oldest at head; allocated on first use
	head  int
	n     int
	bytes int
}

type recentEntry struct {
	d     evt.Delivery
	at    time.Time
	bytes int
}

const (
	recentMaxEntries = 2048
	recentMaxBytes   = 8 << 20
	recentMaxAge     = 5 * time.Second
)

func (r *recentStored) add(d evt.Delivery, now time.Time) {
	size := approxSize(d)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ring == nil {
		r.ring = make([]recentEntry, recentMaxEntries)
	}
	for r.n > 0 && (r.n == len(r.ring) || r.bytes+size > recentMaxBytes || now.Sub(r.ring[r.head].at) > recentMaxAge) {
		r.bytes -= r.ring[r.head].bytes
		r.ring[r.head] = recentEntry{} // the event can go
		r.head = (r.head + 1) % len(r.ring)
		r.n--
	}
	r.ring[(r.head+r.n)%len(r.ring)] = recentEntry{d: d, at: now, bytes: size}
	r.n++
	r.bytes += size
}

// matching returns the kept deliveries one of sub's queried filters matches, oldest first.
// Called as the subscription registers; its query's snapshot then says which of them it missed.
// The lock is held only to copy: Deliver waits on it.
func (r *recentStored) matching(sub *subscription, now time.Time) []evt.Delivery {
	r.mu.Lock()
	kept := make([]recentEntry, 0, r.n)
	for i := 0; i < r.n; i++ {
		kept = append(kept, r.ring[(r.head+i)%len(r.ring)])
	}
	r.mu.Unlock()
	var out []evt.Delivery
	for _, e := range kept {
		if now.Sub(e.at) <= recentMaxAge && sub.matchesQueried(e.d, newTagIndex(e.d.Event)) {
			out = append(out, e.d)
		}
	}
	return out
}

func approxSize(d evt.Delivery) int {
	n := 256 + len(d.Event.Content)
	for _, t := range d.Event.Tags {
		for _, v := range t {
			n += len(v) + 8
		}
	}
	return n
}
