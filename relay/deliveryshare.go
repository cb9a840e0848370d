package relay

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// deliveryShares bounds what one client (limitKey) makes the relay spend on live delivery, across
// its connections (issue 29, finding 4). Each connection matches its inbox on its own goroutine
// (inbox.go), but one address holding 48 connections × 32 catch-all subscriptions still had 48
// goroutines runnable for every event, each matching 32 subscriptions and building 32 copies, and
// another client's event waited behind all of them for the CPU. Two bounds, both per client:
//
//   - a token bucket of delivery units (DeliveryRatePerIP per second, burst DeliveryBurstPerIP):
//     each copy sent costs one unit and one more per KiB, an event that matched nothing one
//     (its matching). A client in debt waits before its next turn; meanwhile its deliveries wait
//     in its inboxes, whose bounds close it as a slow client when it stays over for long. This
//     bounds what it costs the machine (matching, copies, writes, the kernel's socket work).
//   - slots: at most deliverySlots of its connections take a turn at the same time; the others
//     wait blocked, out of the scheduler's run queue. Another client's delivery then waits
//     behind at most that many of its turns (one event each), not behind all of its connections.
//
// The bucket runs on debt: a turn is charged after it ran (its cost is known then), and the next
// waits until the debt is paid. A rate of 0 means unlimited.
type deliveryShares struct {
	rate, burst float64
	slots       int

	mu     sync.Mutex
	shares map[string]*deliveryShare
}

// deliveryShare is one client's: its slots and its bucket.
type deliveryShare struct {
	parent *deliveryShares
	slots  chan struct{}
	refs   int // connections that joined and have not left (under deliveryShares.mu)

	mu     sync.Mutex
	tokens float64
	last   time.Time
}

// deliverySlots is how many connections of one client match at once: half the processors, so
// that one client cannot hold them all, and at least one.
func deliverySlots() int { return max(1, runtime.GOMAXPROCS(0)/2) }

func newDeliveryShares(rate float64, burst, slots int) *deliveryShares {
	return &deliveryShares{rate: rate, burst: float64(max(burst, 1)), slots: max(slots, 1), shares: map[string]*deliveryShare{}}
}

// join returns key's share, which the caller holds until leave.
func (d *deliveryShares) join(key string) *deliveryShare {
	d.mu.Lock()
	defer d.mu.Unlock()
	sh := d.shares[key]
	if sh == nil {
		sh = &deliveryShare{parent: d, slots: make(chan struct{}, d.slots), tokens: d.burst, last: timeNow()}
		d.shares[key] = sh
	}
	sh.refs++
	return sh
}

func (d *deliveryShares) leave(key string, sh *deliveryShare) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if sh.refs--; sh.refs == 0 {
		delete(d.shares, key)
	}
}

// turn waits for one of the client's slots, then until the client is out of debt; false when ctx
// ended first. A true turn must be ended with done. The debt is paid holding the slot: the
// client's other connections wait blocked on the slot meanwhile, instead of all waking together
// when the debt is paid and running one turn each.
func (sh *deliveryShare) turn(ctx context.Context) bool {
	select {
	case sh.slots <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	for waited := false; ; waited = true {
		wait := sh.debt()
		if wait <= 0 {
			return true
		}
		if !waited {
			metrics.DeliveryThrottled.Inc()
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			<-sh.slots
			return false
		case <-t.C:
		}
	}
}

// done frees the slot turn took and charges the turn's cost.
func (sh *deliveryShare) done(cost int) {
	<-sh.slots
	sh.charge(cost)
}

// charge takes cost from the bucket, into debt if need be.
func (sh *deliveryShare) charge(cost int) { sh.chargeAt(cost, timeNow()) }

func (sh *deliveryShare) chargeAt(cost int, now time.Time) {
	if sh.parent.rate <= 0 || cost == 0 {
		return
	}
	sh.mu.Lock()
	sh.refill(now)
	sh.tokens -= float64(cost)
	sh.mu.Unlock()
}

// debt is how long the client must wait until its bucket holds no debt: 0 when it does not.
func (sh *deliveryShare) debt() time.Duration { return sh.debtAt(timeNow()) }

func (sh *deliveryShare) debtAt(now time.Time) time.Duration {
	if sh.parent.rate <= 0 {
		return 0
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.refill(now)
	if sh.tokens >= 0 {
		return 0
	}
	return time.Duration(-sh.tokens / sh.parent.rate * float64(time.Second))
}

// refill adds what the time since the last refill earned, up to the burst. Caller holds sh.mu.
func (sh *deliveryShare) refill(now time.Time) {
	if dt := now.Sub(sh.last); dt > 0 {
		sh.tokens = min(sh.parent.burst, sh.tokens+dt.Seconds()*sh.parent.rate)
		sh.last = now
	}
}

// deliveryCost is what one turn costs: a unit per copy and one more per KiB of it, and one for
// matching when nothing matched.
func deliveryCost(msgs [][]byte) int {
	if len(msgs) == 0 {
		return 1
	}
	cost := 0
	for _, m := range msgs {
		cost += 1 + len(m)>>10
	}
	return cost
}
