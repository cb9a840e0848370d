package relay

import (
	"fmt"
	"testing"

	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Issue 29, finding 5: nothing bounded the live subscriptions of the process, whose
// de-duplication windows took it from 139 MB to 960 MB. TestSubscriptionsPerProcess: past
// MaxSubscriptionsTotal a REQ from any address is CLOSED restricted: and counted
// (bound="process"), takes no per-IP place, and a place comes back when a subscription ends.
func TestSubscriptionsPerProcess(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxSubscriptionsTotal = 3 })
	b := newSubBound(t, tr.s.allSubs, "process", "restricted: the relay holds as many subscriptions")
	a, _ := tr.dialFrom(t, "127.0.0.10", false)
	c, _ := tr.dialFrom(t, "127.0.0.11", false)
	b.steps(subStep{a, "a1", false}, subStep{a, "a2", false}, subStep{c, "b1", false}, subStep{c, "b2", true},
		subStep{a, "a3", true}, subStep{a, "a1", false})
	if n := b.refusals(); n != 2 {
		t.Fatalf("refusals counted %v, want 2", n)
	}
	if n := b.held(""); n != 3 {
		t.Fatalf("the process holds %d places, want 3", n)
	}
	tr.s.ipSubs.mu.Lock()
	ipB := tr.s.ipSubs.held["127.0.0.11"]
	tr.s.ipSubs.mu.Unlock()
	if ipB != 1 {
		t.Fatalf("127.0.0.11 holds %d per-IP places, want 1 (a refused REQ takes none)", ipB)
	}
	a.ws.Close()
	b.waitHeld("", 1) // after a's connection ended
	if got := b.open(c, "b2"); got != "" {
		t.Fatalf("REQ after places came back: CLOSED %q", got)
	}
}

// TestDedupWindowsWithinBudget: a window grows with what it is sent while the process's budget
// has room; past it, windows stop at dedupMinWindow ids and forget their oldest, still refusing
// the repeats they hold; closing gives every id back.
func TestDedupWindowsWithinBudget(t *testing.T) {
	b := newDedupBudget(int64(3 * dedupMinWindow * dedupIDBytes)) // room for three minimal windows
	before := testutil.ToFloat64(metrics.DedupBytes)
	key := func(w, i int) idKey { return idKey{byte(w), byte(i), byte(i >> 8)} }
	windows := make([]*idFIFO[idKey], 4)
	for w := range windows {
		windows[w] = newIDFIFO[idKey](seenPerSub)
		windows[w].budget = b
	}
	// The first window takes the whole budget and more: it grows while there is room.
	for i := 0; i < 5*dedupMinWindow; i++ {
		windows[0].add(key(0, i))
	}
	if n := len(windows[0].ring); n != 3*dedupMinWindow {
		t.Fatalf("first window holds %d ids, want the budget's %d", n, 3*dedupMinWindow)
	}
	// The others still get their minimum, and no more.
	for w := 1; w < 4; w++ {
		for i := 0; i < 2*dedupMinWindow; i++ {
			windows[w].add(key(w, i))
		}
		if n := len(windows[w].ring); n != dedupMinWindow {
			t.Fatalf("window %d holds %d ids, want %d", w, n, dedupMinWindow)
		}
		if windows[w].add(key(w, 2*dedupMinWindow-1)) {
			t.Fatalf("window %d took its newest id twice", w)
		}
		if !windows[w].add(key(w, 0)) {
			t.Fatalf("window %d still holds its oldest id past its size", w)
		}
	}
	// Exact on the budget; the gauge (buzz_dedup_bytes) is shared with whatever an earlier
	// test's connections still give back, so it is only checked to have grown.
	if got, want := b.held.Load(), int64(6*dedupMinWindow); got != want {
		t.Fatalf("the budget holds %d ids, want %d", got, want)
	}
	if testutil.ToFloat64(metrics.DedupBytes)-before < float64(5*dedupMinWindow*dedupIDBytes) {
		t.Fatalf("buzz_dedup_bytes grew by %v only", testutil.ToFloat64(metrics.DedupBytes)-before)
	}
	windows[0].shrink(dedupMinWindow)
	for _, w := range windows {
		w.release()
	}
	if b.held.Load() != 0 {
		t.Fatalf("after release the budget holds %d ids, want 0", b.held.Load())
	}
}

// TestInboxOverflowClosesTheSlowMatcher: a connection whose live deliveries wait to be matched
// past InboxEvents is closed as a slow client (reason inbox), without the fan-out waiting for it,
// while another connection gets every event; its entries are given back to its address.
func TestInboxOverflowClosesTheSlowMatcher(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.InboxEvents = 2 })
	sk, pk := testenv.NewKey()
	f := nostr.Filter{Authors: []string{pk}, LimitZero: true}
	other := tr.dial(t)
	other.req("o", f)
	stuck, sc := tr.dialFrom(t, "127.0.0.12", false)
	stuck.req("s", f)
	before := testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues("inbox"))
	sc.deliverMu.Lock() // its goroutine matches nothing meanwhile
	for i := 0; i < 4; i++ {
		ev := signed(sk, 1, fmt.Sprint("e", i), nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
		if got := other.nextEvent("o"); got.ID != ev.ID { // one at a time: its inbox never fills
			t.Fatalf("the other connection got %s, want %s", got.ID, ev.ID)
		}
	}
	sc.deliverMu.Unlock()
	tr.expectInboxClose(t, sc, "the stuck one", before)
	tr.s.ipInbox.mu.Lock()
	left := tr.s.ipInbox.held["127.0.0.12"]
	tr.s.ipInbox.mu.Unlock()
	if left != 0 {
		t.Fatalf("127.0.0.12 still holds %d inbox entries after its connection ended", left)
	}
}
