package relay

// Two read-side guards of docs/design.md, Reads, limits and isolation: the per-connection bound on
// queries in flight (conn.querySem, acquireQuery) and the read gate compiled into the SQL ahead
// of LIMIT (filter_sql.go).

import (
	"bytes"
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Guard: acquireQuery (a semaphore of MaxQueriesInFlight per connection) before every REQ and
// COUNT query. Without it one client's flood of queries takes the whole query pool and starves
// every other connection's reads.
//
// The flooding connection is authenticated, so its gate reads buzz.members; a test transaction
// holds an ACCESS EXCLUSIVE lock on that table, and each of its queries that starts waits for the
// lock in PostgreSQL, where pg_stat_activity shows it. The other connection is anonymous: its gate
// does not touch buzz.members, so its REQ runs. The barrier is "bound queries wait on the lock and
// the read loop is parked in acquireQuery" or "more than bound queries wait": both are observed
// states, so no sleep decides the outcome.
func TestQueriesInFlightBoundedPerConnection(t *testing.T) {
	const bound = 2
	url := testenv.FreshDB(t) // only this test's queries in its pg_stat_activity rows
	tr := startRelayOn(t, url, func(c *Config) {
		c.MaxQueriesInFlight = bound
		c.QueryTimeout = time.Minute // the test releases the queries itself
	})
	sk, pk := testenv.NewKey()
	note := signed(sk, 1, "public", nostr.Now())
	flood := tr.dial(t)
	flood.mustAuth(sk, tr.url)
	flood.mustPublish(note)
	other := tr.dial(t)

	lock := lockMembers(t, url)

	// Twice the bound, REQs and COUNTs alternating: they share one bound.
	f := nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}
	want := map[string]string{} // subscription id -> the answer's verb
	for i := range 2 * bound {
		id := fmt.Sprint("flood-", i)
		verb := map[bool]string{true: "REQ", false: "COUNT"}[i%2 == 0]
		flood.sendJSON(verb, id, f)
		want[id] = map[string]string{"REQ": "EOSE", "COUNT": "COUNT"}[verb]
	}

	waiting := func() int { return queriesWaitingOnLocks(t, tr, url) }
	var n int
	testenv.WaitUntil(t, 20*time.Second, "the flood's queries waiting on the lock", func() bool {
		n = waiting()
		return n > bound || (n == bound && boundReadLoopParkedInAcquire())
	})
	if n != bound {
		t.Fatalf("%d queries of one connection in flight, the bound is %d", n, bound)
	}

	// Another connection is still answered meanwhile, and the flood has not grown.
	sameIDs(t, "REQ of another connection while the flood waits", other.req("other", f), note)
	if n := waiting(); n != bound {
		t.Fatalf("%d queries of the flooding connection in flight after another connection's REQ, the bound is %d", n, bound)
	}

	// Released, every query of the flood is answered: the bound delays them, it drops none.
	lock.Rollback()
	for len(want) > 0 {
		m := flood.read()
		id := ""
		if len(m) > 1 {
			id = str(m[1])
		}
		switch v := flood.verb(m); {
		case v == want[id]:
			delete(want, id)
		case v == "CLOSED" || v == "NOTICE":
			t.Fatalf("flood answered with %s", joinRaw(m))
		}
	}
}

// boundReadLoopParkedInAcquire reports whether a connection's read loop is blocked in
// acquireQuery: the next query waits for the bound instead of starting.
func boundReadLoopParkedInAcquire() bool {
	return parkedIn("relay.(*conn).acquireQuery(", "relay.(*conn).run(")
}

// Guard: the read gate is part of the WHERE clause, before ORDER BY ... LIMIT (filter_sql.go
// whereSQL). Applied after the limit, the newest matching rows could all be unreadable and a
// reader would get fewer rows than exist for it, or none: here the newest match of A's kinds 1
// and 9 is a DM message, and limit 1 must still give a non-member A's public note.
func TestLimitCountsOnlyReadableRows(t *testing.T) {
	tr := startRelay(t, nil)
	author := newParty(t, tr, true)
	member := newParty(t, tr, true)
	outsider := newParty(t, tr, true) // authenticated, not a member of the DM
	anon := newParty(t, tr, false)

	note := signed(author.sk, 1, "public", nostr.Now()-10)
	author.c.mustPublish(note)
	ch := openDM(t, author, member.pk)
	dm := signed(author.sk, 9, "secret", nostr.Now(), nostr.Tag{"h", ch})
	author.c.mustPublish(dm)

	f := nostr.Filter{Authors: []string{author.pk}, Kinds: []int{1, 9}, Limit: 1}
	sameIDs(t, "member (the DM message is the newest match)", member.c.req("limit", f), dm)
	sameIDs(t, "authenticated non-member", outsider.c.req("limit", f), note)
	sameIDs(t, "anonymous", anon.c.req("limit", f), note)
}

// Guard: ipQueries, the share of the query pool one client IP may hold across its connections.
// Two connections of one client (each within its per-connection bound of 2) hold at most 3
// queries in PostgreSQL; a client at another address is still answered. Same barrier as above:
// the queries wait on a table lock, and the next one is observed parked in the IP's share.
func TestQueriesInFlightBoundedPerIP(t *testing.T) {
	const perConn, perIP = 2, 3
	url := testenv.FreshDB(t)
	tr := startRelayOn(t, url, func(c *Config) {
		c.MaxQueriesInFlight, c.MaxQueriesPerIP = perConn, perIP
		c.QueryTimeout = time.Minute
		c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	})
	sk, pk := testenv.NewKey()
	note := signed(sk, 1, "public", nostr.Now())
	a, b := dialFrom(t, tr, "198.51.100.7"), dialFrom(t, tr, "198.51.100.7")
	for _, c := range []*client{a, b} {
		c.mustAuth(sk, tr.url) // authenticated: their gates read buzz.members
	}
	a.mustPublish(note)
	other := dialFrom(t, tr, "203.0.113.5")

	lock := lockMembers(t, url)
	f := nostr.Filter{Authors: []string{pk}, Kinds: []int{1}}
	answers := 0
	for _, c := range []*client{a, b} {
		for i := range perConn {
			c.sendJSON("REQ", fmt.Sprint("q", i), f)
			answers++
		}
	}
	waiting := func() int { return queriesWaitingOnLocks(t, tr, url) }
	var n int
	testenv.WaitUntil(t, 20*time.Second, "the client's queries waiting on the lock", func() bool {
		n = waiting()
		return n > perIP || (n == perIP && parkedIn("relay.(*ipQueries).acquire("))
	})
	if n != perIP {
		t.Fatalf("%d queries of one client in flight, its share is %d", n, perIP)
	}
	sameIDs(t, "REQ of a client at another address", other.req("other", f), note)

	lock.Rollback()
	for _, c := range []*client{a, b} { // answers in any order
		want := map[string]bool{}
		for i := range perConn {
			want[fmt.Sprint("q", i)] = true
		}
		for len(want) > 0 {
			m := c.read()
			switch c.verb(m) {
			case "EOSE":
				delete(want, str(m[1]))
			case "CLOSED":
				t.Fatalf("a query of the client, released: %s", joinRaw(m))
			}
		}
	}
}

// parkedIn reports whether some goroutine is blocked in a select with every one of fns (function
// names as runtime.Stack prints them) on its stack.
func parkedIn(fns ...string) bool {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		if bytes.Contains(g, []byte(" [select")) && allIn(g, fns) {
			return true
		}
	}
	return false
}

func allIn(g []byte, fns []string) bool {
	for _, fn := range fns {
		if !bytes.Contains(g, []byte(fn)) {
			return false
		}
	}
	return true
}

// queriesWaitingOnLocks counts the relay's query-pool backends on url's database that wait for a
// lock (pg_stat_activity).
func queriesWaitingOnLocks(t *testing.T, tr *testRelay, url string) int {
	t.Helper()
	var n int
	if err := tr.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
		WHERE datname = $1 AND application_name = 'buzzpg-query:test' AND wait_event_type = 'Lock'`,
		testenv.DatabaseName(url)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A read loop that waits for the client's own queries (the per-connection bound) does not count
// that wait against the connection's read deadline: renewed before handling, a wait longer than
// the deadline made the next read fail at once and dropped a client that had done nothing wrong.
// The read deadline is shortened to 1 s (short enough for a test, long enough that a loaded
// machine does not trip it elsewhere), and the wait outlasts it (a sleep: the deadline's expiry
// is the scenario itself, not an ordering of steps).
func TestWaitingForOwnQueriesKeepsTheConnection(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxQueriesInFlight = 1 })
	tr.s.readWait = time.Second
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	note := signed(sk, 1, "public", nostr.Now())
	c.mustPublish(note)
	f := nostr.Filter{Authors: []string{pk}}
	reached, release := holdFirstAnswer(t)
	c.sendJSON("REQ", "held", f)
	<-reached
	c.sendJSON("REQ", "waits", f) // the read loop now waits for "held"'s slot
	testenv.WaitUntil(t, 10*time.Second, "the read loop waiting for the query slot", boundReadLoopParkedInAcquire)
	time.Sleep(2 * tr.s.readWait)
	close(release)
	for _, id := range []string{"held", "waits"} {
		if got, closed := c.collect(id); closed != "" || len(got) != 1 {
			t.Fatalf("REQ %s: %d events, CLOSED %q", id, len(got), closed)
		}
	}
	sameIDs(t, "a REQ after the wait", c.req("after", f), note)
}

// The client's share is held while its query runs, not while the rows are sent: an answer held
// after its query (a slow reader, here the relay.req.queried hook) does not hold up the next
// query of another connection at the same address.
func TestIPShareNotHeldWhileSending(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxQueriesPerIP = 1 })
	sk, pk := testenv.NewKey()
	note := signed(sk, 1, "public", nostr.Now())
	slow, next := tr.dial(t), tr.dial(t) // both 127.0.0.1
	slow.mustPublish(note)
	f := nostr.Filter{Authors: []string{pk}}
	reached, release := holdFirstAnswer(t)
	slow.sendJSON("REQ", "held", f)
	<-reached
	sameIDs(t, "another connection of the address while an answer is held", next.req("next", f), note)
	close(release)
	if got, closed := slow.collect("held"); closed != "" || len(got) != 1 {
		t.Fatalf("the held answer: %d events, CLOSED %q", len(got), closed)
	}
}

// lockMembers holds buzz.members in ACCESS EXCLUSIVE mode on its own session until Rollback (or
// the test's end): authenticated clients' gate SQL reads the table, so their queries wait.
func lockMembers(t *testing.T, url string) *testenv.Session {
	t.Helper()
	lock := testenv.NewSession(t, url, "members-lock")
	lock.Begin()
	t.Cleanup(func() { _ = lock.Tx.Rollback(context.Background()) })
	if _, err := lock.Tx.Exec(context.Background(), `LOCK TABLE buzz.members IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return lock
}
