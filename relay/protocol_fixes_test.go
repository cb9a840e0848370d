package relay

// Guards of protocol fixes: a REQ refused at parse time ends the subscription it names (and only
// that one), a panicking initial query ends its subscription, gate lookups take the client's share
// of the query pool, and one client IP's answers hold at most its share of the initial-result budget.

import (
	"context"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// liveCounts counts the EVENTs c receives per subscription until a fresh REQ's EOSE: everything a
// returned Deliver call enqueued precedes it.
func liveCounts(t *testing.T, c *client) map[string]int {
	t.Helper()
	probe := "probe-" + nonce()
	c.sendJSON("REQ", probe, nostr.Filter{IDs: []string{randHex64()}})
	got := map[string]int{}
	for {
		m := c.read()
		switch c.verb(m) {
		case "EVENT":
			got[str(m[1])]++
		case "EOSE":
			if str(m[1]) == probe {
				c.sendJSON("CLOSE", probe)
				return got
			}
		}
	}
}

// dialFrom connects as a client at ip, behind a trusted proxy (the relay must trust 127.0.0.0/8).
func dialFrom(t *testing.T, tr *testRelay, ip string) *client {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(tr.url, http.Header{"X-Forwarded-For": {ip}})
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { ws.Close() })
	c := &client{t: t, ws: ws}
	c.challenge = str(c.expect("AUTH")[1])
	return c
}

// Guard: conn.handle ends the subscription a malformed REQ names before answering CLOSED, as
// handleReq does for a REQ that parses but is refused. Left registered, the subscription the
// CLOSED ended for the client went on receiving live events. Another subscription is untouched.
func TestMalformedREQEndsItsSubscription(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	f := nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}
	for _, bad := range []struct{ raw, reason string }{
		{`["REQ","s",{"kinds":["1"]}]`, "invalid: malformed filter"},
		{`["REQ","s",[1]]`, "invalid: filters must be JSON objects"},
		{`["REQ","s"]`, "invalid: REQ needs at least one filter"},
	} {
		c.req("s", f)
		c.req("other", f)
		c.sendRaw([]byte(bad.raw))
		if m := c.expect("CLOSED"); str(m[1]) != "s" || str(m[2]) != bad.reason {
			t.Fatalf("%s: %s, want CLOSED s %q", bad.raw, joinRaw(m), bad.reason)
		}
		ev := signed(sk, 1, "live after "+bad.raw, nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
		if got := liveCounts(t, c); got["s"] != 0 || got["other"] != 1 {
			t.Fatalf("after %s: live events per subscription %v, want none for the CLOSED s and one for other", bad.raw, got)
		}
		c.sendJSON("CLOSE", "other")
	}
}

// Guard: parseClientMessage names a refused subscription id as sent (never cut to 64 characters,
// which could name another, live subscription), counts its length in characters (NIP-01), and
// answers an id too long to echo with a NOTICE.
func TestSubIDLengthInCharacters(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	f := nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}

	id64 := strings.Repeat("a", maxSubIDLength)
	c.req(id64, f)
	over := id64 + "a"
	c.sendJSON("REQ", over, f)
	if m := c.expect("CLOSED"); str(m[1]) != over || !strings.HasPrefix(str(m[2]), "invalid: subscription id must be 1-64 characters") {
		t.Fatalf("65-character id: %s, want a CLOSED naming it", joinRaw(m))
	}
	c.sendJSON("REQ", strings.Repeat("b", 2*maxEchoedSubIDBytes), f)
	if m := c.read(); c.verb(m) != "NOTICE" || str(m[1]) != "invalid: subscription id must be 1-64 characters" {
		t.Fatalf("id too long to echo: %s (%s), want a NOTICE", c.verb(m), str(m[len(m)-1]))
	}
	ev := signed(sk, 1, "live", nostr.Now())
	tr.s.DeliverEvent(publicDelivery(&ev))
	if got := liveCounts(t, c); got[id64] != 1 {
		t.Fatalf("live events per subscription %v: the 64-character one must still receive", got)
	}

	// 64 two-byte characters are 128 bytes, and within the limit.
	wide := strings.Repeat("é", maxSubIDLength)
	c.req(wide, f)
	c.sendJSON("REQ", wide+"é", f)
	if m := c.expect("CLOSED"); str(m[1]) != wide+"é" || !strings.HasPrefix(str(m[2]), "invalid:") {
		t.Fatalf("65 two-byte characters: %s", joinRaw(m))
	}
	ev2 := signed(sk, 1, "live again", nostr.Now())
	tr.s.DeliverEvent(publicDelivery(&ev2))
	if got := liveCounts(t, c); got[id64] != 1 || got[wide] != 1 {
		t.Fatalf("live events per subscription %v, want one for each", got)
	}
}

// Guard: recoverQuery removes the REQ's subscription before its CLOSED. The first initial query
// panics (at the hook after the query); the subscription must then get no live events.
func TestQueryPanicEndsItsSubscription(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	var once sync.Once
	t.Cleanup(hooks.Set("relay.req.queried", func(context.Context) {
		once.Do(func() { panic("test: query goroutine panics") })
	}))
	f := nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}
	if _, closed := c.reqOrClosed("s", f); closed != "error: internal error" {
		t.Fatalf("REQ whose query panicked: CLOSED %q", closed)
	}
	ev := signed(sk, 1, "live", nostr.Now())
	tr.s.DeliverEvent(publicDelivery(&ev))
	syncNone(t, c, "s")
	c.req("t", f) // the connection and its later REQs work
}

// Guard: checkGates' member lookup takes the client IP's share of the query pool (ipQueries), as
// queries do. Two connections of one client, each with a REQ naming a channel, hold at most the
// share of lookups in PostgreSQL. Barrier as in TestQueriesInFlightBoundedPerIP: the lookups wait
// on a lock on buzz.members, and the next is observed parked in the IP's share.
func TestGateLookupsTakeTheIPShare(t *testing.T) {
	const perIP = 1
	url := testenv.FreshDB(t)
	tr := startRelayOn(t, url, func(c *Config) {
		c.MaxQueriesPerIP = perIP
		c.QueryTimeout = time.Minute
		c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	})
	tr.s.memberWait = time.Minute // the test releases the lookups itself
	sk, pk := testenv.NewKey()
	_, peer := testenv.NewKey()
	a, b := dialFrom(t, tr, "198.51.100.7"), dialFrom(t, tr, "198.51.100.7")
	for _, c := range []*client{a, b} {
		c.mustAuth(sk, tr.url)
	}
	ch := openDM(t, party{sk, pk, a}, peer)
	note := signed(sk, 1, "public", nostr.Now())
	a.mustPublish(note)
	other := dialFrom(t, tr, "203.0.113.5")

	lock := lockMembers(t, url)
	for _, c := range []*client{a, b} {
		c.sendJSON("REQ", "g", nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": {ch}}})
	}
	var n int
	testenv.WaitUntil(t, 20*time.Second, "the client's lookups waiting on the lock", func() bool {
		n = queriesWaitingOnLocks(t, tr, url)
		return n > perIP || (n == perIP && parkedIn("relay.(*ipQueries).acquire(", "relay.(*conn).checkGates("))
	})
	if n != perIP {
		t.Fatalf("%d member lookups of one client in flight, its share is %d", n, perIP)
	}
	sameIDs(t, "REQ of a client at another address", other.req("other", nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}), note)

	lock.Rollback()
	for _, c := range []*client{a, b} {
		if _, closed := c.collect("g"); closed != "" {
			t.Fatalf("a member's REQ, released: CLOSED %q", closed)
		}
	}

	// The set is cached now: with the client's share all held, a REQ naming the DM does not stop
	// the connection's reads waiting for one (its query waits in the background instead).
	if !tr.s.ipQueries.acquire(context.Background(), "198.51.100.7") {
		t.Fatal("could not take the client's share")
	}
	defer tr.s.ipQueries.release("198.51.100.7")
	a.sendJSON("REQ", "cached", nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": {ch}}})
	a.mustPublish(signed(sk, 1, "the read loop goes on", nostr.Now()))
}

// Guard: takeInitial charges the client IP's share (InitialResultPerIP) beside the connection's.
// One connection's answer is held after its query; a second connection from the same address finds
// the address's share spent and is told so, while a client at another address gets its answer.
// Once sent, every byte is given back and the address's entry is gone.
func TestInitialResultsPerIPShare(t *testing.T) {
	const share = 8 << 10
	tr := startRelay(t, func(c *Config) {
		c.InitialResultPerIP = share
		c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	})
	const addr = "198.51.100.7"
	truncated := func() float64 { return testutil.ToFloat64(metrics.InitialTruncated.WithLabelValues("ip")) }
	before := truncated()
	a := dialFrom(t, tr, addr)
	f, alone := cutAnswer(t, tr, a, "the 8 KiB share of the address")
	ipHeld := func() (int64, int) {
		tr.s.ipInitial.mu.Lock()
		defer tr.s.ipInitial.mu.Unlock()
		return tr.s.ipInitial.held[addr], len(tr.s.ipInitial.held)
	}

	reached, release := holdFirstAnswer(t)
	a.sendJSON("REQ", "held", f)
	select { // a REQ refused before its query never gets there: fail, do not hang
	case <-reached:
	case <-time.After(readTimeout):
		t.Fatal("the REQ to hold never reached its rows: refused (is its share given back?)")
	}
	b := dialFrom(t, tr, addr)
	if got, closed := b.reqOrClosed("second", f); len(got) != 0 || closed != "error: relay busy, try again" {
		t.Fatalf("another connection of the address holding its share: %d events, CLOSED %q; want a busy CLOSED", len(got), closed)
	}
	if held, _ := ipHeld(); held <= 0 || held > share {
		t.Fatalf("the address holds %d bytes, its share is %d", held, share)
	}
	other := dialFrom(t, tr, "203.0.113.5")
	if got := other.req("other", f); len(got) != alone {
		t.Fatalf("a client at another address meanwhile: %d events, want %d", len(got), alone)
	}
	close(release)
	if got, _ := a.collect("held"); len(got) != alone {
		t.Fatalf("the held answer: %d events, want %d", len(got), alone)
	}
	if d := truncated() - before; d < 2 { // the cut answer and the refused one
		t.Fatalf(`buzz_initial_results_truncated_total{bound="ip"} moved by %v, want at least 2`, d)
	}
	testenv.WaitUntil(t, 10*time.Second, "every byte given back, no entry left", func() bool {
		_, entries := ipHeld()
		return tr.s.initial.used.Load() == 0 && entries == 0
	})
}
