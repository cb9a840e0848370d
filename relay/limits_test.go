package relay

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestRateLimits(t *testing.T) {
	tr := startRelay(t, func(c *Config) {
		c.EventRate, c.EventBurst = 0.001, 2 // two EVENTs, then none for a long time
		c.ReqRate, c.ReqBurst = 0.001, 2
	})
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	now := nostr.Now()
	c.mustPublish(signed(sk, 1, "1", now))
	c.mustPublish(signed(sk, 1, "2", now))
	third := signed(sk, 1, "3", now)
	if r := c.publish(third); r.ok || !strings.HasPrefix(r.msg, "rate-limited:") {
		t.Fatalf("third EVENT: %+v", r)
	}
	if n := tr.eventCount(t, "id = $1", third.ID); n != 0 {
		t.Fatal("rate-limited event stored")
	}
	// AUTH draws on the same bucket: each costs a signature check.
	auth := authEvent(sk, c.challenge, tr.url, now)
	c.sendJSON("AUTH", auth)
	if r := parseOK(t, c.expect("OK")); r.ok || !strings.HasPrefix(r.msg, "rate-limited:") {
		t.Fatalf("AUTH past the EVENT budget: %+v", r)
	}
	c.req("a", nostr.Filter{Authors: []string{pk}})
	c.req("b", nostr.Filter{Authors: []string{pk}})
	if _, closed := c.reqOrClosed("c", nostr.Filter{Authors: []string{pk}}); !strings.HasPrefix(closed, "rate-limited:") {
		t.Fatalf("third REQ: %q", closed)
	}
	// Another connection has its own budget.
	c2 := tr.dial(t)
	c2.mustPublish(third)
}

// TestQueriesDoNotStallAcceptance: with every query-pool connection taken (a flood of expensive
// REQs), EVENTs are still accepted at once, and a REQ ends with "error: query timed out" instead
// of hanging.
func TestQueriesDoNotStallAcceptance(t *testing.T) {
	// The OK must arrive while the REQ is still stuck. The query timeout only has to outlast
	// accepting one EVENT on a loaded machine: the test releases the connections itself instead
	// of waiting for it.
	tr := startRelay(t, func(c *Config) { c.QueryTimeout = 10 * time.Second })
	release := holdAll(t, tr.s.query)
	released := false
	defer func() {
		if !released {
			release()
		}
	}()
	c := tr.dial(t)
	sk, _ := testenv.NewKey()
	c.sendJSON("REQ", "slow", nostr.Filter{Kinds: []int{1}, Limit: 10})
	ev := signed(sk, 1, "still accepted", nostr.Now())
	start := time.Now()
	c.sendJSON("EVENT", ev)
	// Replies in arrival order: the OK must come without waiting for the stuck query.
	for gotOK := false; !gotOK; {
		m := c.read()
		switch c.verb(m) {
		case "OK":
			if r := parseOK(t, m); !r.ok {
				t.Fatalf("EVENT refused: %s", r.msg)
			}
			if d := time.Since(start); d > time.Second {
				t.Logf("OK after %s (loaded machine?)", d)
			}
			gotOK = true
		case "CLOSED":
			t.Fatalf("OK waited for the query to time out: %s", joinRaw(m))
		case "EOSE":
			t.Fatal("query answered although no query connection was free")
		}
	}
	// The REQ was waiting for a connection, not dropped: freed, it is answered.
	release()
	released = true
	if _, closed := c.collect("slow"); closed != "" {
		t.Fatalf("REQ closed after the connections were freed: %s", closed)
	}

	// A REQ that gets no query connection within the query timeout is ended, not left hanging.
	tr2 := startRelay(t, func(c *Config) { c.QueryTimeout = time.Second })
	defer holdAll(t, tr2.s.query)()
	c2 := tr2.dial(t)
	c2.sendJSON("REQ", "slow", nostr.Filter{Kinds: []int{1}, Limit: 10})
	for {
		m := c2.read()
		switch c2.verb(m) {
		case "CLOSED":
			if str(m[1]) != "slow" || !strings.HasPrefix(str(m[2]), "error: query timed out") {
				t.Fatalf("CLOSED: %s", joinRaw(m))
			}
			return
		case "EOSE":
			t.Fatal("query answered although no query connection was free")
		}
	}
}

// TestQueryConnStatementTimeout: query-pool connections carry the query timeout server-side too.
func TestQueryConnStatementTimeout(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.QueryTimeout = 1500 * time.Millisecond })
	ctx := context.Background()
	for i := 0; i < 3; i++ { // a fresh and a reused connection
		pc, err := tr.s.acquireQueryConn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var v string
		if err := pc.QueryRow(ctx, `SHOW statement_timeout`).Scan(&v); err != nil {
			t.Fatal(err)
		}
		pc.Release()
		if v != "1500ms" {
			t.Fatalf("statement_timeout = %q", v)
		}
	}
	// And a query running longer than that is ended by PostgreSQL itself.
	pc, err := tr.s.acquireQueryConn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Release()
	_, err = pc.Exec(ctx, `SELECT pg_sleep(5)`)
	if !isTimeout(err) {
		t.Fatalf("pg_sleep(5): %v", err)
	}
}

// A client that keeps sending while every message is refused is told and disconnected; one that
// stays within its budget is not.
func TestIgnoringRateLimitsDisconnects(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.EventRate, c.EventBurst = 0.001, 1 })
	c := tr.dial(t)
	sk, _ := testenv.NewKey()
	c.mustPublish(signed(sk, 1, "within budget", nostr.Now()))
	ev := signed(sk, 1, "over budget", nostr.Now())
	// The first refusal is awaited: closing drops replies still queued, so of the pipelined ones
	// none may arrive on a loaded machine.
	if r := c.publish(ev); r.ok || !strings.HasPrefix(r.msg, "rate-limited:") {
		t.Fatalf("over budget: %+v", r)
	}
	refused := 0
	counted := func() float64 { return testutil.ToFloat64(metrics.RateLimited.WithLabelValues("EVENT")) }
	before := counted() - 1 // the refusal awaited above
	for i := 1; i < maxLimitedStreak; i++ {
		c.sendJSON("EVENT", ev)
	}
	// Frames after the one that closes the connection are read but not handled (before, the
	// read loop went on handling them, one accept_event each, for the 2 s the close may take).
	extra, _ := json.Marshal([]any{"EVENT", ev})
	for i := 0; i < 500; i++ {
		if err := c.ws.WriteMessage(websocket.TextMessage, extra); err != nil {
			break // the relay may have closed already
		}
	}
	var notice string
	for {
		m, err := c.tryRead(10 * time.Second)
		if err != nil {
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != websocket.ClosePolicyViolation {
				t.Fatalf("connection ended with %v, want close 1008", err)
			}
			break
		}
		switch c.verb(m) {
		case "OK":
			if r := parseOK(t, m); r.ok || !strings.HasPrefix(r.msg, "rate-limited:") {
				t.Fatalf("over budget: %+v", r)
			}
			refused++
		case "NOTICE":
			notice = str(m[1])
		}
	}
	// Closing drops replies still queued, so fewer OKs than refusals may arrive.
	if refused > maxLimitedStreak-1 || !strings.HasPrefix(notice, "rate-limited:") {
		t.Fatalf("refused %d more (at most %d), notice %q", refused, maxLimitedStreak-1, notice)
	}
	<-tr.closed // the read loop is done: nothing more can be handled
	if n := counted() - before; n != maxLimitedStreak {
		t.Fatalf("%v EVENTs handled as rate-limited, want %d: frames after the close were handled", n, maxLimitedStreak)
	}
}
