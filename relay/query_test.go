package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

func nonce() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func randHex64() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// TestFilters stores a small fixed set through EVENT and checks every filter field, their
// combinations, ordering (newest first, ties by lowest id), limit, and several filters in one REQ.
func TestFilters(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	skA, pkA := testenv.NewKey()
	skB, pkB := testenv.NewKey()
	tagT := "t-" + nonce() // unique per run: the package database is shared by tests
	refE, refP := randHex64(), randHex64()
	base := int64(nostr.Now()) - 10000

	e1 := signed(skA, 1, "one", nostr.Timestamp(base+1), nostr.Tag{"t", tagT})
	e2 := signed(skA, 1, "two", nostr.Timestamp(base+2), nostr.Tag{"e", refE}, nostr.Tag{"p", refP})
	e3 := signed(skA, 7, "three", nostr.Timestamp(base+3), nostr.Tag{"t", tagT + "x"}, nostr.Tag{"q", "quux-" + tagT})
	e4 := signed(skA, 30023, "four", nostr.Timestamp(base+4), nostr.Tag{"d", "art-" + tagT})
	e5 := signed(skA, 1, "five", nostr.Timestamp(base+5))
	e6 := signed(skA, 1, "six", nostr.Timestamp(base+5)) // same created_at as e5
	f1 := signed(skB, 1, "b-one", nostr.Timestamp(base+3), nostr.Tag{"t", tagT})
	for _, ev := range []nostr.Event{e1, e2, e3, e4, e5, e6, f1} {
		c.mustPublish(ev)
	}
	tie1, tie2 := e5, e6
	if e6.ID < e5.ID {
		tie1, tie2 = e6, e5
	}
	A, B := []string{pkA}, []string{pkB}

	cases := []struct {
		name string
		f    []nostr.Filter
		want []nostr.Event
	}{
		{"authors newest first, tie by lowest id", []nostr.Filter{{Authors: A}}, []nostr.Event{tie1, tie2, e4, e3, e2, e1}},
		{"ids", []nostr.Filter{{IDs: []string{e2.ID, f1.ID}}}, []nostr.Event{f1, e2}},
		{"kinds+authors", []nostr.Filter{{Kinds: []int{7}, Authors: A}}, []nostr.Event{e3}},
		{"several kinds", []nostr.Filter{{Kinds: []int{7, 30023}, Authors: A}}, []nostr.Event{e4, e3}},
		{"#t across authors", []nostr.Filter{{Tags: nostr.TagMap{"t": {tagT}}}}, []nostr.Event{f1, e1}},
		{"#t two values", []nostr.Filter{{Tags: nostr.TagMap{"t": {tagT, tagT + "x"}}, Authors: A}}, []nostr.Event{e3, e1}},
		{"#e", []nostr.Filter{{Tags: nostr.TagMap{"e": {refE}}}}, []nostr.Event{e2}},
		{"#p", []nostr.Filter{{Tags: nostr.TagMap{"p": {refP}}}}, []nostr.Event{e2}},
		{"#e and #p", []nostr.Filter{{Tags: nostr.TagMap{"e": {refE}, "p": {refP}}}}, []nostr.Event{e2}},
		{"#e and #p mismatch", []nostr.Filter{{Tags: nostr.TagMap{"e": {refE}, "p": {refE}}}}, nil},
		{"#d", []nostr.Filter{{Tags: nostr.TagMap{"d": {"art-" + tagT}}}}, []nostr.Event{e4}},
		{"arbitrary letter #q", []nostr.Filter{{Tags: nostr.TagMap{"q": {"quux-" + tagT}}}}, []nostr.Event{e3}},
		{"since", []nostr.Filter{{Authors: A, Since: ts(base + 4)}}, []nostr.Event{tie1, tie2, e4}},
		{"until", []nostr.Filter{{Authors: A, Until: ts(base + 2)}}, []nostr.Event{e2, e1}},
		{"since+until", []nostr.Filter{{Authors: A, Since: ts(base + 2), Until: ts(base + 3)}}, []nostr.Event{e3, e2}},
		{"since > until", []nostr.Filter{{Authors: A, Since: ts(base + 3), Until: ts(base + 2)}}, nil},
		{"limit", []nostr.Filter{{Authors: A, Limit: 3}}, []nostr.Event{tie1, tie2, e4}},
		{"limit 0", []nostr.Filter{{Authors: A, Limit: 0, LimitZero: true}}, nil},
		{"kinds+authors+since+limit", []nostr.Filter{{Kinds: []int{1}, Authors: A, Since: ts(base + 2), Limit: 2}}, []nostr.Event{tie1, tie2}},
		{"several filters merged and de-duplicated", []nostr.Filter{
			{IDs: []string{e1.ID}},
			{Kinds: []int{7}, Authors: A},
			{IDs: []string{e1.ID, e3.ID}},
			{Authors: B},
		}, orderTie(e3, f1, e1)},
		{"each filter its own limit", []nostr.Filter{{Authors: A, Limit: 1}, {Authors: B, Limit: 1}}, []nostr.Event{tie1, f1}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := c.req("s"+string(rune('a'+i)), tc.f...)
			sameIDs(t, tc.name, got, tc.want...)
			c.sendJSON("CLOSE", "s"+string(rune('a'+i)))
		})
	}

	t.Run("empty list matches nothing", func(t *testing.T) {
		c.sendRaw([]byte(`["REQ","empty",{"ids":[]},{"authors":[],"kinds":[1]},{"#t":[]}]`))
		got, closed := c.collect("empty")
		if closed != "" || len(got) != 0 {
			t.Fatalf("got %d events, closed %q", len(got), closed)
		}
	})

	t.Run("COUNT", func(t *testing.T) {
		n, closed := c.count("c1", nostr.Filter{Authors: A})
		if closed != "" || n != 6 {
			t.Fatalf("COUNT authors A = %d %q, want 6", n, closed)
		}
		n, _ = c.count("c2", nostr.Filter{Authors: A, Kinds: []int{1}}, nostr.Filter{Tags: nostr.TagMap{"t": {tagT}}})
		if n != 5 { // e1 e2 e5 e6 (kind 1 of A) + f1; e1 counted once
			t.Fatalf("COUNT union = %d, want 5", n)
		}
	})
}

// orderTie returns a, b (equal created_at) ordered by id, followed by rest.
func orderTie(a, b nostr.Event, rest ...nostr.Event) []nostr.Event {
	if b.ID < a.ID {
		a, b = b, a
	}
	return append([]nostr.Event{a, b}, rest...)
}

// TestCloseAndReplace: CLOSE stops live delivery; a REQ with the same id replaces the filters.
func TestCloseAndReplace(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	base := int64(nostr.Now()) - 100
	e1 := signed(sk, 1, "a", nostr.Timestamp(base))
	e2 := signed(sk, 7, "b", nostr.Timestamp(base+1))
	c.mustPublish(e1)
	c.mustPublish(e2)

	// sync proves nothing else is pending: replies come in order, and a Deliver that returned has
	// enqueued everything it would send before this REQ's EOSE.
	sync := func(n int) {
		t.Helper()
		sub := "sync" + string(rune('0'+n))
		got, closed := c.reqOrClosed(sub, nostr.Filter{IDs: []string{randHex64()}})
		if closed != "" || len(got) != 0 {
			t.Fatalf("sync: %v %q", got, closed)
		}
	}
	live := func(ev nostr.Event) { tr.s.DeliverEvent(publicDelivery(&ev)) }

	sameIDs(t, "first REQ", c.req("s", nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}), e1)
	sameIDs(t, "replacing REQ", c.req("s", nostr.Filter{Authors: []string{pk}, Kinds: []int{7}}), e2)
	e3 := signed(sk, 1, "c", nostr.Timestamp(base+2)) // matches only the replaced filter
	e4 := signed(sk, 7, "d", nostr.Timestamp(base+3)) // matches the new one
	live(e3)
	live(e4)
	if got := c.nextEvent("s"); got.ID != e4.ID {
		t.Fatalf("after replacement got %s, want %s", got.ID, e4.ID)
	}
	sync(1)

	c.sendJSON("CLOSE", "s")
	sync(2)
	live(signed(sk, 7, "e", nostr.Timestamp(base+4)))
	// A probe REQ's EOSE comes after anything that Deliver enqueued; nothing for "s" may precede it.
	c.sendJSON("REQ", "probe", nostr.Filter{Authors: []string{pk}, Kinds: []int{7}, Limit: 1})
	for {
		m := c.read()
		if c.verb(m) == "EVENT" && str(m[1]) == "s" {
			t.Fatalf("closed subscription received %s", joinRaw(m))
		}
		if c.verb(m) == "EOSE" && str(m[1]) == "probe" {
			break
		}
	}
}

// TestExpiredEventsAreNotServed: NIP-40 expired events are neither returned by REQ nor counted.
// Expiry is simulated by moving the stored expires_at into the past (time passing).
func TestExpiredEventsAreNotServed(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	now := nostr.Now()
	expiring := signed(sk, 1, "soon gone", now, nostr.Tag{"expiration", fmt.Sprint(int64(now) + 3600)})
	lasting := signed(sk, 1, "stays", now-1)
	c.mustPublish(expiring)
	c.mustPublish(lasting)
	f := nostr.Filter{Authors: []string{pk}}
	sameIDs(t, "before expiry", c.req("x1", f), expiring, lasting)
	if _, err := tr.pool.Exec(context.Background(),
		`UPDATE buzz.events SET expires_at = buzz.now_unix() - 1 WHERE id = $1`, expiring.ID); err != nil {
		t.Fatal(err)
	}
	sameIDs(t, "after expiry", c.req("x2", f), lasting)
	sameIDs(t, "by id", c.req("x3", nostr.Filter{IDs: []string{expiring.ID}}))
	if n, closed := c.count("x4", f); n != 1 || closed != "" {
		t.Fatalf("COUNT after expiry = %d %q, want 1", n, closed)
	}
}

// TestLiveDedupAroundInitialQuery drives the two races of "register, then query" with hooks:
// an event committed after registration but before the query is both live and in the query;
// an event delivered live after the query ran is also among the query's rows. Each must reach
// the client exactly once.
func TestLiveDedupAroundInitialQuery(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	base := int64(nostr.Now()) - 100
	old := signed(sk, 1, "old", nostr.Timestamp(base))
	c.mustPublish(old)
	during := signed(sk, 1, "during", nostr.Timestamp(base+1))

	remove1 := hooks.Set("relay.req.registered", func(ctx context.Context) {
		// Committed after registration, before the query: the query sees it, and so does the tail.
		if ok, msg, err := tr.s.acceptEvent(ctx, &during); err != nil || !ok {
			t.Errorf("accept during: %v %s", err, msg)
		}
		tr.s.DeliverEvent(publicDelivery(&during))
	})
	after := signed(sk, 1, "after", nostr.Timestamp(base+1))
	remove2 := hooks.Set("relay.req.queried", func(ctx context.Context) {
		// Replication lagging behind the query: "old" arrives live after being queried.
		tr.s.DeliverEvent(publicDelivery(&old))
		// Committed after the query's snapshot: only the live subscription can carry it, so it
		// is lost unless the subscription was registered before the query ran.
		tr.s.DeliverEvent(publicDelivery(&after))
	})
	got := c.req("s", nostr.Filter{Authors: []string{pk}})
	remove1()
	remove2()
	seen := map[string]int{}
	for _, ev := range got {
		seen[ev.ID]++
	}
	if seen[after.ID] == 0 { // live events may follow EOSE
		ev := c.nextEvent("s")
		seen[ev.ID]++
	}
	if seen[old.ID] != 1 || seen[during.ID] != 1 || seen[after.ID] != 1 || len(seen) != 3 {
		t.Fatalf("want each event once, got %v", seen)
	}
	// And later live deliveries of the same ids are dropped too.
	tr.s.DeliverEvent(publicDelivery(&old))
	fresh := signed(sk, 1, "fresh", nostr.Timestamp(base+2))
	tr.s.DeliverEvent(publicDelivery(&fresh))
	if ev := c.nextEvent("s"); ev.ID != fresh.ID {
		t.Fatalf("re-delivered %s", ev.Content)
	}
}

// Initial results held in memory until sent are bounded across connections: while one REQ's
// answer waits (held at a hook after its query), another REQ finds nothing left and is told so;
// once sent, the budget is whole again.
func TestInitialResultsShareOneBudget(t *testing.T) {
	// One answer held: the other REQ finds the budget spent.
	tr, c, f, alone, holder, release := spentBudget(t)
	// Not an empty EOSE, which would read as "no history": a CLOSED that says why.
	if got, closed := c.reqOrClosed("starved", f); len(got) != 0 || closed != "error: relay busy, try again" {
		t.Fatalf("with the budget held by another answer: %d events, CLOSED %q; want a busy CLOSED", len(got), closed)
	}
	close(release)
	if got, _ := holder.collect("held"); len(got) != alone {
		t.Fatalf("the held answer: %d events, want %d", len(got), alone)
	}
	testenv.WaitUntil(t, 10*time.Second, "the budget given back", func() bool { return tr.s.initial.used.Load() == 0 })
	if got := c.req("again", f); len(got) != alone {
		t.Fatalf("after the held answer was sent: %d events, want %d", len(got), alone)
	}
}

// One connection's answers hold at most its share of the budget (InitialResultPerConn): a client
// reading slowly on a few connections cannot take all of it. The connection whose earlier answer
// is held gets the busy CLOSED; another connection is still answered in full.
func TestInitialResultsPerConnectionShare(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.InitialResultPerConn = 8 << 10 })
	c := tr.dial(t)
	f, alone := cutAnswer(t, tr, c, "the 8 KiB share")

	reached, release := holdFirstAnswer(t)
	c.sendJSON("REQ", "held", f)
	<-reached
	if got, closed := c.reqOrClosed("second", f); len(got) != 0 || closed != "error: relay busy, try again" {
		t.Fatalf("a second answer on the connection holding its share: %d events, CLOSED %q; want a busy CLOSED", len(got), closed)
	}
	other := tr.dial(t)
	if got := other.req("other", f); len(got) != alone {
		t.Fatalf("another connection meanwhile: %d events, want %d", len(got), alone)
	}
	close(release)
	if got, _ := c.collect("held"); len(got) != alone {
		t.Fatalf("the held answer: %d events, want %d", len(got), alone)
	}
}

// storeBudgetEvents publishes n events of about 560 bytes each through c and returns them
// (oldest first) with a filter matching exactly them.
func storeBudgetEvents(c *client, n int) ([]nostr.Event, nostr.Filter) {
	c.t.Helper()
	sk, pk := testenv.NewKey()
	base := int64(nostr.Now()) - 1000
	stored := make([]nostr.Event, 0, n)
	for i := range n {
		ev := signed(sk, 1, strings.Repeat("x", 300), nostr.Timestamp(base+int64(i)))
		c.mustPublish(ev)
		stored = append(stored, ev)
	}
	return stored, nostr.Filter{Authors: []string{pk}}
}

// holdFirstAnswer pauses the first REQ whose query completes from now on, after its query and
// before its rows are sent (hook relay.req.queried): reached is closed when it is there, and
// closing release lets it go on. The hook is removed at cleanup.
func holdFirstAnswer(t *testing.T) (reached <-chan struct{}, release chan<- struct{}) {
	r, rel := make(chan struct{}), make(chan struct{})
	var once sync.Once
	t.Cleanup(hooks.Set("relay.req.queried", func(ctx context.Context) {
		first := false
		once.Do(func() { first = true })
		if first {
			close(r)
			<-rel
		}
	}))
	return r, rel
}

// spentBudget starts a relay with an 8 KiB initial-result budget and holds all of it: the answer
// of REQ "held" on holder waits at a hook (holdFirstAnswer) until release is closed. f matches
// that answer's events, alone of which fit the budget; c is another connection.
func spentBudget(t *testing.T) (tr *testRelay, c *client, f nostr.Filter, alone int, holder *client, release chan<- struct{}) {
	t.Helper()
	tr = startRelay(t, func(c *Config) { c.InitialResultBudget = 8 << 10 })
	c = tr.dial(t)
	f, alone = cutAnswer(t, tr, c, "the 8 KiB budget")
	reached, release := holdFirstAnswer(t)
	holder = tr.dial(t)
	holder.sendJSON("REQ", "held", f)
	<-reached
	return tr, c, f, alone, holder, release
}

// cutAnswer stores 20 events of about 560 bytes through c and asks for them alone: the answer is
// cut at an 8 KiB bound (bound names it), newest first. It returns the filter and how many
// events fit, once the bytes are given back (which may follow the client's EOSE by a moment).
func cutAnswer(t *testing.T, tr *testRelay, c *client, bound string) (nostr.Filter, int) {
	t.Helper()
	const n = 20
	stored, f := storeBudgetEvents(c, n)
	got := c.req("alone", f)
	if len(got) == 0 || len(got) >= n || got[0].ID != stored[n-1].ID {
		t.Fatalf("alone under %s: %d of %d events (first %v)", bound, len(got), n, ids(got[:min(1, len(got))]))
	}
	testenv.WaitUntil(t, 10*time.Second, "the bytes given back after the answer", func() bool { return tr.s.initial.used.Load() == 0 })
	return f, len(got)
}

// A REQ whose answer fails (here: the budget is spent) ends with CLOSED, unless a REQ reusing its
// id replaced it in the meantime: the CLOSED would then name the new subscription, which the
// client would drop while the relay went on delivering to it. The replacement comes after the
// failed REQ's check of its own context (hook relay.req.busy), the window the check alone missed.
func TestFailedREQDoesNotCloseItsReplacement(t *testing.T) {
	tr, c, f, _, holder, release := spentBudget(t)

	busy, goOn, ended := make(chan struct{}), make(chan struct{}), make(chan struct{})
	t.Cleanup(hooks.Set("relay.req.busy", func(context.Context) { close(busy); <-goOn }))
	t.Cleanup(hooks.Set("relay.req.busy.ended", func(context.Context) { close(ended) }))
	c.sendJSON("REQ", "x", f) // finds the budget spent
	<-busy
	sk, pk := testenv.NewKey()
	if got, closed := c.reqOrClosed("x", nostr.Filter{Authors: []string{pk}, LimitZero: true}); len(got) != 0 || closed != "" {
		t.Fatalf("the replacing REQ: %d events, CLOSED %q; want an empty EOSE", len(got), closed)
	}
	close(goOn)
	<-ended
	live := signed(sk, 1, "live", nostr.Now())
	tr.s.DeliverEvent(publicDelivery(&live))
	for {
		m := c.read()
		if len(m) < 2 || str(m[1]) != "x" {
			continue
		}
		if c.verb(m) == "CLOSED" {
			t.Fatalf("the failed REQ's CLOSED named its replacement: %s", joinRaw(m))
		}
		if c.verb(m) == "EVENT" {
			break
		}
	}
	close(release)
	if _, closed := holder.collect("held"); closed != "" {
		t.Fatalf("the held answer closed: %s", closed)
	}
}
