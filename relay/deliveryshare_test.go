package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// TestDeliveryShareBucket: a client's bucket runs into debt by what its turns cost and is paid
// back at the rate, up to the burst; clients do not share one; no rate, no debt.
func TestDeliveryShareBucket(t *testing.T) {
	d := newDeliveryShares(1000, 100, 1)
	a, b := d.join("a"), d.join("b")
	t0 := a.last
	a.chargeAt(300, t0) // 100 in the bucket, 200 of debt: 200 ms at 1,000 a second
	for _, step := range []struct {
		after time.Duration
		want  time.Duration
	}{{0, 200 * time.Millisecond}, {50 * time.Millisecond, 150 * time.Millisecond}, {200 * time.Millisecond, 0}} {
		if got := a.debtAt(t0.Add(step.after)); !near(got, step.want) {
			t.Fatalf("after %v the debt is %v, want %v", step.after, got, step.want)
		}
	}
	if got := b.debtAt(t0); got != 0 {
		t.Fatalf("another client owes %v for a's turns", got)
	}
	later := t0.Add(time.Hour) // the bucket refills to its burst, no further
	a.chargeAt(100, later)
	if got := a.debtAt(later); !near(got, 0) {
		t.Fatalf("a full bucket paid a turn of its burst and owes %v", got)
	}
	if a.chargeAt(10, later); !near(a.debtAt(later), 10*time.Millisecond) {
		t.Fatalf("past the burst the debt is %v, want 10ms", a.debtAt(later))
	}
	d.leave("a", a)
	d.leave("b", b)
	if len(d.shares) != 0 {
		t.Fatalf("%d shares left after every connection left", len(d.shares))
	}
	free := newDeliveryShares(-1, 1, 1).join("a")
	if free.chargeAt(1e6, t0); free.debtAt(t0) != 0 {
		t.Fatal("an unlimited share owes something")
	}
}

// near: the bucket counts in floating point.
func near(got, want time.Duration) bool {
	return got-want < time.Microsecond && want-got < time.Microsecond
}

// TestDeliveryShareSlots: a client's turns beyond its slots wait blocked until one is done, and a
// turn that gives up while it waits for the debt gives its slot back.
func TestDeliveryShareSlots(t *testing.T) {
	d := newDeliveryShares(1000, 10, 1)
	a := d.join("a")
	if !a.turn(context.Background()) {
		t.Fatal("the first turn did not start")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if a.turn(ctx) {
		t.Fatal("a second turn started while the only slot was taken")
	}
	if b := d.join("b"); !b.turn(context.Background()) {
		t.Fatal("another client's turn waited for a's slot")
	}
	a.done(1010) // a second of debt
	ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if a.turn(ctx) {
		t.Fatal("a turn started a second in debt")
	}
	select {
	case a.slots <- struct{}{}:
	default:
		t.Fatal("a turn that gave up kept its slot")
	}
}

// TestDeliveryBudgetDelaysTheClientOverIt: a client whose live deliveries cost more than its
// budget gets them all, later, while another address's delivery does not wait for it; the wait is
// counted in buzz_delivery_throttled_total. This is what keeps one address's flood of copies from
// taking the machine from everyone else (tests/fairness_test.go measures it end to end).
func TestDeliveryBudgetDelaysTheClientOverIt(t *testing.T) {
	// 300 copies of one unit: the last turn starts when the 240 units its predecessors took past
	// the burst are paid, 240 ms after the first.
	const subs, events = 10, 30
	tr := startRelay(t, func(c *Config) { c.DeliveryRatePerIP, c.DeliveryBurstPerIP = 1000, 50 })
	sk, pk := testenv.NewKey()
	f := nostr.Filter{Authors: []string{pk}, LimitZero: true}
	heavy, _ := tr.dialFrom(t, "127.0.0.14", false)
	for i := 0; i < subs; i++ {
		heavy.req(fmt.Sprint("h", i), f)
	}
	light, _ := tr.dialFrom(t, "127.0.0.15", false)
	light.req("l", f)
	before := testutil.ToFloat64(metrics.DeliveryThrottled)
	start := time.Now()
	for i := 0; i < events; i++ {
		ev := signed(sk, 1, fmt.Sprint("e", i), nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
	}
	for i := 0; i < events; i++ {
		light.nextEvent("l")
	}
	lightTook := time.Since(start)
	got := map[string]int{}
	for n := 0; n < subs*events; n++ {
		got[str(heavy.expect("EVENT")[1])]++
	}
	heavyTook := time.Since(start)
	for i := 0; i < subs; i++ {
		if n := got[fmt.Sprint("h", i)]; n != events {
			t.Fatalf("subscription h%d got %d events, want %d", i, n, events)
		}
	}
	t.Logf("the client over its budget got its copies in %v, the other one in %v", heavyTook, lightTook)
	if heavyTook < 200*time.Millisecond {
		t.Fatalf("300 units with a burst of 50 at 1,000 a second took %v, want about 240ms", heavyTook)
	}
	if lightTook >= heavyTook {
		t.Fatalf("the other address waited %v, the client over its budget %v", lightTook, heavyTook)
	}
	if testutil.ToFloat64(metrics.DeliveryThrottled) == before {
		t.Fatal("buzz_delivery_throttled_total did not grow")
	}
}

// TestDeliveryBudgetOverflowClosesTheClient: a client that stays over its budget has its
// deliveries wait in its inbox until the inbox's bound, then is told (NOTICE) and closed as a
// slow client: nothing is dropped without a signal. The events come 20 ms apart, which the
// connection would match as they come without the budget.
func TestDeliveryBudgetOverflowClosesTheClient(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.DeliveryRatePerIP, c.DeliveryBurstPerIP, c.InboxEvents = 10, 1, 4 })
	sk, pk := testenv.NewKey()
	heavy, hc := tr.dialFrom(t, "127.0.0.16", false)
	heavy.req("h", nostr.Filter{Authors: []string{pk}, LimitZero: true})
	before := testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues("inbox"))
	for i := 0; i < 20; i++ {
		ev := signed(sk, 1, fmt.Sprint("e", i), nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
		time.Sleep(20 * time.Millisecond)
	}
	for {
		m, err := heavy.tryRead(3 * time.Second)
		if err != nil {
			t.Fatalf("no NOTICE (the connection was not closed as slow): %v", err)
		}
		if heavy.verb(m) == "NOTICE" {
			if got := str(m[1]); got != "error: too slow, send queue full" {
				t.Fatalf("NOTICE %q", got)
			}
			break
		}
	}
	tr.expectInboxClose(t, hc, "the one over its budget", before)
}
