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
// as it registers, and sends those its query's snapshot did not see that its filters match.
// Bounded by count, bytes and age: the gap is a commit's last steps, or a synchronous standby's
// reply.
type recentStored struct {
	mu    sync.Mutex
	ring  []*recentEntry // circular, oldest at head; allocated on first use
	xids  []uint32       // ring[i]'s transaction id, side by side: tested without a pointer each
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
		r.xids = make([]uint32, recentMaxEntries)
	}
	for r.n > 0 && (r.n == len(r.ring) || r.bytes+size > recentMaxBytes || now.Sub(r.ring[r.head].at) > recentMaxAge) {
		r.drop()
	}
	tail := (r.head + r.n) % len(r.ring)
	r.ring[tail] = &recentEntry{d: d, ix: ix, at: now, bytes: size}
	r.xids[tail] = d.Xid
	r.n++
	r.bytes += size
}

// taken is what a REQ took from recentStored as it registered: the entries kept then, not yet
// matched (unseen matches them once the query's snapshot is known), and their transaction ids.
type taken struct {
	entries []*recentEntry
	xids    []uint32
}

// take returns the entries kept now, oldest first, for a subscription with a queried filter.
// Called as the subscription registers; its query's snapshot then says which of them it missed
// (unseen). Every REQ pays for it before any limit applies, so the work stays small: nothing for
// a subscription without a queried filter, the lock held only to drop what aged out and copy
// pointers (Deliver waits on it), no filter matched here (most entries are seen by the snapshot,
// and a match costs more than the snapshot's test), and each event's tag index built once, by
// Deliver, not once per REQ (a client repeating REQs while the ring held events with thousands of
// tags cost a core here, review finding).
func (r *recentStored) take(sub *subscription, now time.Time) taken {
	if !sub.hasQueried() {
		return taken{}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// Entries are kept in the order Deliver was handed them, so the aged ones are at the head
	// (one a little out of order stays a little longer, which costs a test, never an event).
	// Dropping them here, not only when the next event comes, spares every REQ after a burst a
	// walk over a full ring of stale entries (a tenth of the relay's CPU for REQs, profiled).
	for r.n > 0 && now.Sub(r.ring[r.head].at) > recentMaxAge {
		r.drop()
	}
	if r.n == 0 {
		return taken{}
	}
	return taken{entries: ringCopy(r.ring, r.head, r.n), xids: ringCopy(r.xids, r.head, r.n)}
}

// ringCopy copies the n elements of a circular buffer that start at head, in order.
func ringCopy[T any](ring []T, head, n int) []T {
	out := make([]T, n)
	if tail := head + n; tail <= len(ring) {
		copy(out, ring[head:tail])
	} else {
		k := copy(out, ring[head:])
		copy(out[k:], ring[:tail-len(ring)])
	}
	return out
}

// unseen returns the taken deliveries snap did not see that one of sub's queried filters
// matches, oldest first (none without a snapshot: there was no query to miss them). The cheap
// test first: the snapshot's comes before the filter's.
func (t taken) unseen(snap *mvccSnapshot, sub *subscription) []evt.Delivery {
	if snap == nil {
		return nil
	}
	var out []evt.Delivery
	for i, xid := range t.xids {
		if !snap.sees(xid) {
			if e := t.entries[i]; sub.matchesQueried(e.d, e.ix) {
				out = append(out, e.d)
			}
		}
	}
	return out
}

// drop forgets the oldest entry; r.mu is held.
func (r *recentStored) drop() {
	r.bytes -= r.ring[r.head].bytes
	r.ring[r.head] = nil // the event can go
	r.head = (r.head + 1) % len(r.ring)
	r.n--
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
