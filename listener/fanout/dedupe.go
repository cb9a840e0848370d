package fanout

import (
	"strconv"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// dueKey identifies a due signal: the event id and the stamp (a reminder version re-claimed after
// a lease is a new signal with the same id). An event's key is its id.
func dueKey(d evt.Due) string {
	return d.Event.ID + "/" + strconv.FormatInt(d.Stamp, 10)
}

// recentKeys remembers the last n keys (FIFO eviction), a backstop behind the two exact checks:
// our position drops whole transactions we handled, and txnProgress the first part of a
// transaction a broken session was handing over. What is left for it: a non-transactional message
// handed over after our last commit and resent, and a resend that the position and the count
// cannot place (e.g. after a new slot forgot the position). A resend adds its own keys as it
// goes, so one of more than n deliveries evicts the keys it would meet later and none is caught;
// a single transaction may hold far more than n, which is why the count, not this window, guards
// a transaction resent after a break.
type recentKeys struct {
	ring []deliveryKey
	next int
	set  map[deliveryKey]struct{}
}

// deliveryKey is one delivery: the transaction's commit position (or a non-transactional
// message's own) and the event's key (dueKey). Comparable, so no string is built per event.
type deliveryKey struct {
	at  uint64
	key string
}

func newRecentKeys(n int) *recentKeys {
	return &recentKeys{ring: make([]deliveryKey, n), set: make(map[deliveryKey]struct{}, n)}
}

// add records key and reports whether it was new.
func (r *recentKeys) add(key deliveryKey) bool {
	if _, ok := r.set[key]; ok {
		return false
	}
	if old := r.ring[r.next]; old.key != "" {
		delete(r.set, old)
	}
	r.ring[r.next] = key
	r.next = (r.next + 1) % len(r.ring)
	r.set[key] = struct{}{}
	return true
}
