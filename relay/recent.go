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
	ring  []*recentEntry // circular, oldest at head; allocated on first use
	head  int
	n     int
	bytes int
}

// recentEntry is never changed once kept, so matching can read it after the lock is gone.
type recentEntry struct {
	d     evt.Delivery
	ix    tagIndex // Deliver's index of the event's tags (nil for few tags), built once
	at    time.Time
	bytes int
}

const (
	recentMaxEntries = 2048
	recentMaxBytes   = 8 << 20
	recentMaxAge     = 5 * time.Second
)

func (r *recentStored) add(d evt.Delivery, ix tagIndex, now time.Time) {
	size := approxSize(d)
	if ix != nil {
		size += indexedTagBytes * len(ix)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.ring == nil {
		r.ring = make([]*recentEntry, recentMaxEntries)
	}
	for r.n > 0 && (r.n == len(r.ring) || r.bytes+size > recentMaxBytes || now.Sub(r.ring[r.head].at) > recentMaxAge) {
		r.bytes -= r.ring[r.head].bytes
		r.ring[r.head] = nil // the event can go
		r.head = (r.head + 1) % len(r.ring)
		r.n--
	}
	r.ring[(r.head+r.n)%len(r.ring)] = &recentEntry{d: d, ix: ix, at: now, bytes: size}
	r.n++
	r.bytes += size
}

// matching returns the kept deliveries one of sub's queried filters matches, oldest first.
// Called as the subscription registers; its query's snapshot then says which of them it missed.
// Every REQ pays for it before any limit applies, so the work stays small: nothing for a
// subscription without a queried filter, the lock held only to copy pointers (Deliver waits on
// it), and each event's tag index built once, by Deliver, not once per REQ (a client repeating
// REQs while the ring held events with thousands of tags cost a core here, review finding).
func (r *recentStored) matching(sub *subscription, now time.Time) []evt.Delivery {
	if !sub.hasQueried() {
		return nil
	}
	r.mu.Lock()
	kept := make([]*recentEntry, 0, r.n)
	for i := 0; i < r.n; i++ {
		if e := r.ring[(r.head+i)%len(r.ring)]; now.Sub(e.at) <= recentMaxAge {
			kept = append(kept, e)
		}
	}
	r.mu.Unlock()
	var out []evt.Delivery
	for _, e := range kept {
		if sub.matchesQueried(e.d, e.ix) {
			out = append(out, e.d)
		}
	}
	return out
}

// indexedTagBytes is about what one entry of a tagIndex costs (key, map slot and overhead).
const indexedTagBytes = 64

func approxSize(d evt.Delivery) int {
	n := 256 + len(d.Event.Content)
	for _, t := range d.Event.Tags {
		for _, v := range t {
			n += len(v) + 8
		}
	}
	return n
}
