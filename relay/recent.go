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
	mu      sync.Mutex
	entries []recentEntry // oldest first
	bytes   int
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
	n := approxSize(d)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.entries = append(r.entries, recentEntry{d: d, at: now, bytes: n})
	r.bytes += n
	drop := 0
	for drop < len(r.entries) && (len(r.entries)-drop > recentMaxEntries || r.bytes > recentMaxBytes ||
		now.Sub(r.entries[drop].at) > recentMaxAge) {
		r.bytes -= r.entries[drop].bytes
		drop++
	}
	if drop > 0 {
		// Shift rather than reslice, so the backing array does not keep dropped events alive.
		r.entries = r.entries[:copy(r.entries, r.entries[drop:])]
		clear(r.entries[len(r.entries):cap(r.entries)][:drop])
	}
}

// matching returns the kept deliveries sub's filters match, oldest first. Called as the
// subscription registers; its query's snapshot then says which of them it missed.
func (r *recentStored) matching(sub *subscription, now time.Time) []evt.Delivery {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []evt.Delivery
	for _, e := range r.entries {
		if now.Sub(e.at) <= recentMaxAge && sub.matchesAny(e.d, newTagIndex(e.d.Event)) {
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
