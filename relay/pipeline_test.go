package relay

import (
	"fmt"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// onlyConn is the relay's one connection.
func onlyConn(t *testing.T, tr *testRelay) *conn {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if cs := tr.s.snapshotConns(); len(cs) == 1 {
			return cs[0]
		}
		if time.Now().After(deadline) {
			t.Fatal("no connection")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func windowLen(c *conn) int {
	c.pipe.mu.Lock()
	defer c.pipe.mu.Unlock()
	return len(c.pipe.items)
}

// The window bounds what a connection has read and not had answered: with the database away, the
// read loop stops at EventWindow events (the rest stay in the socket), and every OK comes once
// the database is back, in the order sent.
func TestPipelineWindowStopsReadsWhenFull(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.EventWindow = 4 })
	c := tr.dial(t)
	conn := onlyConn(t, tr)
	release := holdAll(t, tr.pool)
	sk, _ := testenv.NewKey()
	sent := c.sendNotes(sk, 20)
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if n := windowLen(conn); n > 4 {
			release()
			t.Fatalf("%d EVENTs in a window of 4", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := windowLen(conn); n != 4 {
		release()
		t.Fatalf("window holds %d, want it full (4)", n)
	}
	release()
	for i, ev := range sent {
		if r := parseOK(t, c.expect("OK")); r.id != ev.ID || !r.ok {
			t.Fatalf("OK %d: %+v, want ok for %s", i, r, ev.ID)
		}
	}
}

// A REQ waits until the EVENTs sent before it are answered, and then sees them: read-your-writes
// as when each EVENT was answered before the next message was read.
func TestPipelineReqWaitsForEarlierEvents(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	release := holdAll(t, tr.pool)
	sk, pk := testenv.NewKey()
	sent := c.sendNotes(sk, 5)
	c.sendJSON("REQ", "s", nostr.Filter{Authors: []string{pk}})
	time.Sleep(300 * time.Millisecond) // a REQ that did not wait is answered meanwhile
	release()
	for i, ev := range sent {
		m := c.read()
		if c.verb(m) != "OK" {
			t.Fatalf("message %d: %s, want the OK of an EVENT sent before the REQ", i, joinRaw(m))
		}
		if r := parseOK(t, m); r.id != ev.ID || !r.ok {
			t.Fatalf("OK %d: %+v", i, r)
		}
	}
	got, closed := c.collect("s")
	if closed != "" || len(got) != len(sent) {
		t.Fatalf("REQ after the EVENTs: %d events (closed %q), want %d", len(got), closed, len(sent))
	}
}

// A connection that goes away with EVENTs in flight is torn down once the call running them
// returns: the window's worker ends with the connection, and nothing waits for the EVENTs that
// never got their turn.
func TestPipelineDisconnectReleasesTheWindow(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.EventWindow = 4 })
	c := tr.dial(t)
	conn := onlyConn(t, tr)
	release := holdAll(t, tr.pool)
	sk, _ := testenv.NewKey()
	c.sendNotes(sk, 10)
	for windowLen(conn) < 4 {
		time.Sleep(5 * time.Millisecond)
	}
	c.ws.Close()
	time.Sleep(200 * time.Millisecond)
	release()
	select {
	case <-conn.pipe.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the window's worker still runs 5 s after its client left")
	}
	select {
	case cc := <-tr.closed:
		if cc.c != conn {
			t.Fatal("another connection closed")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the connection was not torn down")
	}
}

// sendNotes sends n kind-1 events of sk (content n0, n1, ...) without waiting for their OKs, and
// returns them in the order sent.
func (c *client) sendNotes(sk string, n int) []nostr.Event {
	var sent []nostr.Event
	for i := range n {
		ev := signed(sk, 1, fmt.Sprint("n", i), nostr.Now())
		sent = append(sent, ev)
		c.sendJSON("EVENT", ev)
	}
	return sent
}

// A group grows (store.Grow) by the window's next items in order, decided ones riding along, as
// long as the call takes the ones to store, and never by one read after readBy.
func TestPipelineAfterTakesTheNextItemsReadInTime(t *testing.T) {
	t0 := time.Now()
	p := newPipeline()
	item := func(id string, decided bool, read time.Duration) *pipeItem {
		return &pipeItem{ev: &nostr.Event{ID: id}, decided: decided, read: t0.Add(read)}
	}
	p.items = []*pipeItem{item("g", false, 0), item("a", false, 1), item("x", true, 2), item("b", false, 3),
		item("c", false, 4), item("late", false, 10)}
	ids := func(its []*pipeItem) (out []string) {
		for _, it := range its {
			out = append(out, it.ev.ID)
		}
		return out
	}
	for _, tc := range []struct {
		room   int
		readBy time.Duration
		want   string
	}{
		{2, 9, "[a x b]"},
		{5, 9, "[a x b c]"},
		{5, 10, "[a x b c late]"},
		{5, 2, "[a x]"},
		{0, 9, "[]"},
	} {
		room := tc.room
		fit := func(bool) bool { room--; return room >= 0 }
		if got := fmt.Sprint(ids(p.after(1, fit, t0.Add(tc.readBy)))); got != tc.want {
			t.Errorf("after(1, %d, t0+%v) = %s, want %s", tc.room, tc.readBy, got, tc.want)
		}
	}
}
