package relay

import (
	"context"
	"encoding/hex"
	"sync"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// subscription is one REQ's live side. It is registered before its initial query runs, so an
// event committed meanwhile reaches it through Deliver; seen de-duplicates the two paths while
// the query runs, and snap once it has.
type subscription struct {
	id      string
	filters []*compiledFilter
	values  int    // listed values across filters (maxConnFilterValues)
	prefix  []byte // `["EVENT","<id>",`

	ctx    context.Context // ends when the subscription is closed or replaced
	cancel context.CancelFunc

	mu     sync.Mutex // guards closed, seen, snap and rows; also held while enqueueing one of its events
	closed bool
	seen   *idFIFO[idKey]
	// sentLive holds, until the initial rows and the replayed deliveries (replayUnseen) are sent,
	// the ids delivered live meanwhile: seen may evict them under a flood, and a row of one would
	// then be sent twice. Bounded by
	// sentLiveMax (past it, seen alone decides).
	sentLive map[idKey]struct{}
	snap     *mvccSnapshot // the initial query's; nil until it has run (or when it had nothing to read)
	// rows holds the ids of the initial rows sent, while snap is held, in a subscription that
	// mixes filters with limit 0 and filters with a query (keepRows): a live event its snapshot saw
	// is new to the limit-0 filters, unless a row already sent it (sentAsRow). Bounded by
	// sentRowsMax; past it (rowsCut) every such event counts as sent: never twice, at worst
	// one a limit-0 filter would have had is missed.
	keepRows bool
	rows     map[idKey]struct{}
	rowsCut  bool
	// counted is the index counting this live subscription's filters for countedFor, its
	// connection (interest.watch); nil once closed.
	counted    *interest
	countedFor *conn
	// slot is the client's subscription count this one holds a place in (handleReq), given back
	// at close; nil before and after.
	slot    *ipSlots
	slotKey string
	allSlot *ipSlots // the process's count (MaxSubscriptionsTotal), the same way
}

// answered reports whether the initial query's snapshot saw d's transaction: the query answered
// the event or passed over it. Only stored events: ephemeral ones and due signals are never in an
// answer (a due signal carries no xid). The first delivery committed past the snapshot's WAL
// position ends the snapshot's use (every later one is unseen): a subscription open for days
// holds no snapshot, and no xid is read against one from more than 2^31 transactions ago. Caller
// holds s.mu.
func (s *subscription) answered(d evt.Delivery) bool {
	if s.snap == nil {
		return false
	}
	if d.CommitLSN > s.snap.walPos {
		s.dropSnapshot()
		return false
	}
	return d.Xid != 0 && !isEphemeral(d.Event.Kind) && s.snap.sees(d.Xid)
}

// dropSnapshot forgets the query's snapshot and what only it needed. Caller holds s.mu.
func (s *subscription) dropSnapshot() {
	s.snap = nil
	s.rows, s.rowsCut = nil, false
}

// recordRow notes that the initial row id is being sent (keepRows only). Caller holds s.mu.
func (s *subscription) recordRow(id idKey) {
	if !s.keepRows || s.snap == nil {
		return
	}
	if len(s.rows) >= sentRowsMax {
		s.rowsCut = true
		return
	}
	if s.rows == nil {
		s.rows = map[idKey]struct{}{}
	}
	s.rows[id] = struct{}{}
}

// sentAsRow reports, for a live event id its snapshot saw (answered) that matches a filter with
// limit 0, whether the subscription already sent it: as an initial row of a filter with a query.
// Caller holds s.mu.
func (s *subscription) sentAsRow(id idKey, d evt.Delivery, ix tagIndex) bool {
	if !s.matchesQueried(d, ix) {
		return false // only limit-0 filters match it: no query could have sent it
	}
	if s.rowsCut {
		return true
	}
	_, ok := s.rows[id]
	return ok
}

// isEphemeral: NIP-01 kinds 20000-29999, fanned out and never stored.
func isEphemeral(kind int) bool { return kind >= 20000 && kind < 30000 }

func newSubscription(parent context.Context, id string, filters []*compiledFilter) *subscription {
	ctx, cancel := context.WithCancel(parent)
	metrics.Subscriptions.Inc()
	values := 0
	queried, limitZero := false, false
	for _, f := range filters {
		values += f.values()
		switch {
		case f.none:
		case f.limit > 0:
			queried = true
		default:
			limitZero = true
		}
	}
	return &subscription{
		id:       id,
		filters:  filters,
		values:   values,
		prefix:   eventPrefix(id),
		ctx:      ctx,
		cancel:   cancel,
		seen:     newIDFIFO[idKey](seenPerSub),
		sentLive: map[idKey]struct{}{},
		keepRows: queried && limitZero,
	}
}

func (s *subscription) close() {
	s.mu.Lock()
	was := s.closed
	s.closed = true
	counted, c := s.counted, s.countedFor
	s.counted, s.countedFor = nil, nil
	slot, key, all := s.slot, s.slotKey, s.allSlot
	s.slot, s.allSlot = nil, nil
	s.seen.release()
	s.mu.Unlock()
	if counted != nil {
		counted.change(c, s, -1)
	}
	if slot != nil {
		slot.give(key, 1)
	}
	if all != nil {
		all.give("", 1)
	}
	s.cancel()
	if !was {
		metrics.Subscriptions.Dec()
	}
}

// idKey is an event id reduced to 128 bits: plenty against collisions, a quarter of the memory of
// the hex string.
type idKey [16]byte

func keyOf(id string) idKey {
	var k idKey
	if len(id) >= 32 {
		_, _ = hex.Decode(k[:], []byte(id[:32]))
	}
	return k
}

// keyOfBytes is keyOf for an id in bytes (a row's raw column).
func keyOfBytes(id []byte) idKey {
	var k idKey
	if len(id) >= 32 {
		_, _ = hex.Decode(k[:], id[:32])
	}
	return k
}

// dueKey identifies one due signal of one reminder version.
type dueKey struct {
	id    idKey
	stamp int64
}

// idFIFO is a set that remembers the most recent cap keys: bounded memory for de-duplication.
// With a budget (subscription windows), it grows past dedupMinWindow only while the budget has
// room; a window that stopped short forgets its oldest key for each new one instead.
type idFIFO[K comparable] struct {
	set    map[K]struct{}
	ring   []K
	next   int // the oldest key once the ring has wrapped, else 0
	cap    int
	budget *dedupBudget
}

func newIDFIFO[K comparable](capacity int) *idFIFO[K] {
	return &idFIFO[K]{set: map[K]struct{}{}, cap: capacity}
}

func (f *idFIFO[K]) has(k K) bool {
	_, ok := f.set[k]
	return ok
}

// add inserts k; it reports false when k was already present.
func (f *idFIFO[K]) add(k K) bool {
	if _, ok := f.set[k]; ok {
		return false
	}
	// Only a ring that never wrapped grows: appending after a wrap would break the age order.
	if len(f.ring) < f.cap && f.next == 0 && f.budget.take(len(f.ring)) {
		f.ring = append(f.ring, k)
	} else if len(f.ring) == 0 {
		return true // a released window remembers nothing
	} else {
		delete(f.set, f.ring[f.next])
		f.ring[f.next] = k
		f.next = (f.next + 1) % len(f.ring)
	}
	f.set[k] = struct{}{}
	return true
}

// shrink keeps the newest n keys. A map gives no memory back as keys are deleted, so both the
// map and the ring are made anew.
func (f *idFIFO[K]) shrink(n int) {
	if n >= f.cap {
		return
	}
	total := len(f.ring)
	keep := make([]K, 0, min(n, total))
	for i := max(0, total-n); i < total; i++ {
		keep = append(keep, f.ring[(f.next+i)%total]) // f.next is the oldest once the ring has wrapped, else 0
	}
	f.budget.give(total - len(keep))
	f.ring, f.next, f.cap = keep, 0, n
	f.set = make(map[K]struct{}, len(keep))
	for _, k := range keep {
		f.set[k] = struct{}{}
	}
}

// release forgets every key and gives them back to the budget: the subscription is closed.
func (f *idFIFO[K]) release() {
	f.budget.give(len(f.ring))
	f.ring, f.next, f.cap, f.budget = nil, 0, 0, nil
	f.set = map[K]struct{}{}
}

// handleClose ends a subscription (NIP-01 CLOSE); unknown ids are ignored.
func (c *conn) handleClose(subID string) {
	c.mu.Lock()
	sub := c.subs[subID]
	delete(c.subs, subID)
	c.mu.Unlock()
	if sub != nil {
		sub.close()
	}
}

// endSub ends sub and answers CLOSED with reason, only while sub is the subscription registered
// under its id. A REQ that reused the id removed sub first (under c.mu); a CLOSED after that
// would name its successor, which goes on receiving events. Checked and queued under c.mu, so no
// REQ of that id registers in between (as closeID).
// sub.close() runs after c.mu is released: a sub.mu left held by a panic in its goroutine would
// otherwise keep c.mu, and with it every Deliver to this connection, for good. Out of c.subs, the
// subscription gets nothing from Deliver meanwhile.
func (c *conn) endSub(sub *subscription, reason string) {
	c.mu.Lock()
	current := c.subs[sub.id] == sub
	if current {
		delete(c.subs, sub.id)
		c.sendClosed(sub.id, reason) // never waits (send), as Deliver enqueues under c.mu too
	}
	c.mu.Unlock()
	sub.close()
}
