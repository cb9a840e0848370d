package relay

import (
	"runtime"
	"sync"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// inbox is a connection's queue of live deliveries not yet matched against its subscriptions.
// The fan-out goroutine, which every live event goes through, only finds the candidate
// connections and checks the read gate; matching, de-duplication and building the copies happen
// on each connection's own goroutine (deliverLoop). So a connection holding many subscriptions
// pays for them on its own goroutine, and the Go scheduler shares the CPU between it and every
// other connection's: it no longer delays anyone else's events (issue 29, finding 4). Bounded in
// entries per connection and per client (limitKey) across its connections: a connection that
// cannot keep up is a slow client, closed like one whose send queue overflows.
type inbox struct {
	mu     sync.Mutex
	items  []inboxItem
	closed bool
	wake   chan struct{} // capacity 1
}

// inboxItem is one delivery for one connection: the event, its JSON and tag index, all shared by
// every connection it goes to.
type inboxItem struct {
	d  live
	js []byte
	ix tagIndex
}

func newInbox() *inbox { return &inbox{wake: make(chan struct{}, 1)} }

// put queues it unless the inbox holds limit entries already ("inbox") or the client's
// connections together hold their share of entries while this one holds some ("ip_inbox"). It
// returns "" when queued, "closed" after close.
// An empty inbox always takes one entry: a connection that keeps up is never refused for its
// neighbours' backlog.
func (b *inbox) put(it inboxItem, limit int, ip *ipCounts, key string) string {
	b.mu.Lock()
	switch {
	case b.closed:
		b.mu.Unlock()
		return "closed"
	case len(b.items) >= limit:
		b.mu.Unlock()
		return "inbox"
	case !ip.take(key, 1, len(b.items) == 0):
		b.mu.Unlock()
		return "ip_inbox"
	}
	b.items = append(b.items, it)
	b.mu.Unlock()
	metrics.DeliveryInbox.Inc()
	select {
	case b.wake <- struct{}{}:
	default:
	}
	return ""
}

func (b *inbox) empty() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.items) == 0
}

// next removes and returns the oldest entries, giving their charge back.
func (b *inbox) next(ip *ipCounts, key string) []inboxItem {
	b.mu.Lock()
	items := b.items
	b.items = nil
	b.mu.Unlock()
	ip.give(key, len(items))
	metrics.DeliveryInbox.Sub(float64(len(items)))
	return items
}

// pop removes and returns the oldest entry, giving its charge back.
func (b *inbox) pop(ip *ipCounts, key string) (inboxItem, bool) {
	b.mu.Lock()
	if len(b.items) == 0 {
		b.mu.Unlock()
		return inboxItem{}, false
	}
	it := b.items[0]
	b.items[0] = inboxItem{} // the event can go once sent
	b.items = b.items[1:]
	if len(b.items) == 0 {
		b.items = nil // the backing array goes too
	}
	b.mu.Unlock()
	ip.give(key, 1)
	metrics.DeliveryInbox.Dec()
	return it, true
}

// close refuses further entries and drops those queued, giving their charge back.
func (b *inbox) close(ip *ipCounts, key string) {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.next(ip, key)
}

// queueLive hands a delivery to c's inbox; an inbox that is full makes c a slow client.
func (c *conn) queueLive(d live, js []byte, ix tagIndex) {
	if why := c.inbox.put(inboxItem{d: d, js: js, ix: ix}, c.s.cfg.InboxEvents, c.s.ipInbox, c.ip); why != "" && why != "closed" {
		c.overflow(why)
	}
}

// deliverLoop matches the deliveries queued for c against its subscriptions and queues the copies
// to send, in the order the fan-out handed them over, until the connection ends. Each one is a
// turn within its client's delivery share (deliveryshare.go), and it yields after each: a
// connection with a backlog (many subscriptions, a burst) then takes its turn like every other
// runnable goroutine, one event at a time, instead of running for a whole time slice while the
// connections behind it wait (with 48 such connections on 2 cores, a round of time slices is a
// quarter of a second).
func (c *conn) deliverLoop() {
	defer close(c.deliverDone)
	for {
		select {
		case <-c.inbox.wake:
			for c.deliverTurn() {
				runtime.Gosched()
			}
		case <-c.ctx.Done():
			return
		}
	}
}

// deliverTurn matches the oldest delivery in c's inbox, if any, as a turn of its client's share;
// false when none was left or the connection ended.
func (c *conn) deliverTurn() bool {
	if c.inbox.empty() || !c.share.turn(c.ctx) {
		return false
	}
	cost, ok := c.deliverOne()
	c.share.done(cost)
	return ok
}

// deliverOne matches the oldest delivery in c's inbox, if any, and returns what it cost
// (deliveryCost); false when none was left.
func (c *conn) deliverOne() (cost int, ok bool) {
	c.deliverMu.Lock()
	defer c.deliverMu.Unlock()
	it, ok := c.inbox.pop(c.s.ipInbox, c.ip)
	if !ok || c.ctx.Err() != nil {
		return 0, false
	}
	return c.deliverSafely(it), true
}

// drainInbox matches what c's inbox holds now, on the caller's goroutine, then runs then (if not
// nil) before any later delivery is matched. A REQ sets its query's snapshot this way (runInitial):
// every event the fan-out handed over before the query returned is judged as before, without a
// snapshot, as when the fan-out matched it itself; so does a stream restart (dropSnapshots).
func (c *conn) drainInbox(then func()) {
	c.deliverMu.Lock()
	defer c.deliverMu.Unlock()
	cost := 0
	for _, it := range c.inbox.next(c.s.ipInbox, c.ip) {
		if c.ctx.Err() != nil {
			break // the rest was given back by next; nothing is sent any more
		}
		cost += c.deliverSafely(it)
	}
	c.share.charge(cost) // without waiting: the REQ's answer waits for these
	if then != nil {
		then()
	}
}

// deliverSafely is c.deliver with a panic logged instead of ending the process.
func (c *conn) deliverSafely(it inboxItem) (cost int) {
	defer func() {
		if p := recover(); p != nil {
			c.log.Error("panic in live delivery", "panic", p, "id", it.d.Event.ID)
		}
	}()
	return c.deliver(it.d, it.js, it.ix)
}

// dropSnapshots makes every subscription of c forget its query's snapshot (StreamRestarted).
// Caller holds deliverMu (drainInbox), so the deliveries from before the restart are judged first.
func (c *conn) dropSnapshots() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, sub := range c.subs {
		sub.mu.Lock()
		sub.dropSnapshot()
		sub.mu.Unlock()
	}
}
