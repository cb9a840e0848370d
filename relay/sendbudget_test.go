package relay

import (
	"encoding/json"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// dialFrom connects from localIP (a loopback address: a client of its own for the per-IP bounds)
// and returns the client, past the AUTH challenge, with the relay's side of its connection. A slow
// one gets small socket buffers on both sides, so what it does not read piles up in its send queue
// instead of in the kernel.
func (tr *testRelay) dialFrom(t *testing.T, localIP string, slow bool) (*client, *conn) {
	t.Helper()
	nd := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(localIP)}}
	if slow {
		nd.Control = smallReceiveBuffer
	}
	d := websocket.Dialer{NetDialContext: nd.DialContext}
	ws, _, err := d.Dial(tr.url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	c := &client{t: t, ws: ws}
	c.expect("AUTH") // the relay registered the connection before it sent this
	var newest *conn
	for _, sc := range tr.s.snapshotConns() {
		if newest == nil || sc.id > newest.id {
			newest = sc
		}
	}
	if slow {
		if err := newest.ws.NetConn().(*net.TCPConn).SetWriteBuffer(4096); err != nil {
			t.Fatal(err)
		}
	}
	return c, newest
}

// waitDrained waits until everything queued for sc was written to its socket: the fast readers'
// queues are then empty at the next push, as a reader that keeps up leaves them.
func waitDrained(t *testing.T, sc *conn) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		sc.q.mu.Lock()
		size := sc.q.size
		sc.q.mu.Unlock()
		if size == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("queue of a reader that keeps up still holds %d bytes", size)
		}
		time.Sleep(time.Millisecond)
	}
}

// budgetRun subscribes slowN readers that never read (from slowIPs, in turn) and one that reads
// everything (from fastIP), delivers 32 KiB events two at a time until every slow one is closed, and checks that
// the fast one got each event and that the counts go back to zero. It returns the reasons the
// slow connections were closed with, by buzz_slow_clients_closed_total's label.
func budgetRun(t *testing.T, tr *testRelay, slowIPs []string, slowN int, fastIP string) map[string]float64 {
	sk, pk := testenv.NewKey()
	filter := nostr.Filter{Authors: []string{pk}, Limit: 1}
	var slow []*conn
	for i := 0; i < slowN; i++ {
		c, sc := tr.dialFrom(t, slowIPs[i%len(slowIPs)], true)
		c.sendJSON("REQ", "s", filter)
		c.expect("EOSE") // from here on it never reads
		slow = append(slow, sc)
	}
	fast, fastConn := tr.dialFrom(t, fastIP, false)
	fast.req("s", filter)

	labels := []string{"overflow", "client_share", "send_budget"}
	before := map[string]float64{}
	for _, l := range labels {
		before[l] = testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues(l))
	}
	content := strings.Repeat("x", 32<<10)
	// Deliver until every slow reader's queue is closed (overflow told it so; the connection ends
	// once its close frame is out or its write times out, below).
	for i := 0; slices.ContainsFunc(slow, func(sc *conn) bool { return !sc.q.isClosed() }); i++ {
		if i == 1000 { // 64 MiB: far past every bound these tests set
			t.Fatalf("slow readers still open after %d rounds", i)
		}
		if fastConn.q.isClosed() {
			t.Fatalf("the reader that keeps up was closed at round %d", i)
		}
		// Two at a time: the second finds the first in the fast reader's queue (or being
		// written), as a burst would, which must not count as a backlog.
		var ids []string
		for j := 0; j < 2; j++ {
			ev := signed(sk, 1, content, nostr.Timestamp(int64(nostr.Now())+int64(2*i+j)))
			tr.s.DeliverEvent(publicDelivery(&ev))
			ids = append(ids, ev.ID)
		}
		for _, id := range ids {
			m, err := fast.tryRead(30 * time.Second)
			if err != nil {
				t.Fatalf("fast reader at round %d: %v", i, err)
			}
			var got nostr.Event
			if fast.verb(m) != "EVENT" || json.Unmarshal(m[2], &got) != nil || got.ID != id {
				t.Fatalf("fast reader got %s at round %d, want EVENT %s", m, i, id)
			}
		}
		waitDrained(t, fastConn)
	}
	for range slow {
		select {
		case cc := <-tr.closed:
			if cc.c == fastConn {
				t.Fatalf("the reader that keeps up was closed: %s", cc.reason)
			}
		case <-time.After(60 * time.Second):
			t.Fatal("a slow reader's connection did not end")
		}
	}
	// Each ended connection gave its bytes back; the fast reader's queue is empty.
	waitDrained(t, fastConn)
	if n := tr.s.sends.total.Load(); n != 0 {
		t.Errorf("send budget still counts %d bytes with every slow queue released", n)
	}
	if tr.s.ConnCount() != 1 {
		t.Errorf("%d connections left, want the fast one", tr.s.ConnCount())
	}
	out := map[string]float64{}
	for _, l := range labels {
		out[l] = testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues(l)) - before[l]
	}
	return out
}

// TestSendBudgetClientShare: one client's connections that do not read are closed once their
// queues together pass the client's share, far below what each queue may hold on its own, while
// a connection of the same client that keeps up gets every event.
func TestSendBudgetClientShare(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.SendQueueBytes = 8 << 20; c.SendClientShare = 1 << 20 })
	got := budgetRun(t, tr, []string{"127.0.0.2"}, 4, "127.0.0.2")
	if got["client_share"] != 4 || got["overflow"] != 0 || got["send_budget"] != 0 {
		t.Fatalf("slow readers closed by %v, want all 4 by their client's share", got)
	}
}

// TestSendBudgetProcessWide: readers of several clients, each far within its own queue's bound and
// its client's share, are closed once all queues together pass the process's budget; a reader of
// another client that keeps up gets every event. The last slow reader, alone, meets its own
// queue's bound as soon as the budget (a budget is at least one queue's bound), so either may
// close it.
func TestSendBudgetProcessWide(t *testing.T) {
	tr := startRelay(t, func(c *Config) {
		c.SendQueueBytes, c.SendClientShare, c.SendBudget = 1<<20, 1<<20, 1<<20
	})
	got := budgetRun(t, tr, []string{"127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"}, 4, "127.0.0.7")
	if got["send_budget"] < 3 || got["send_budget"]+got["overflow"] != 4 || got["client_share"] != 0 {
		t.Fatalf("slow readers closed by %v, want 3 or 4 by the process's budget (the last by it or its own bound)", got)
	}
}

// TestSendQueueCountsAgainstItsBudget: the rules of queues in one budget, in KiB.
func TestSendQueueCountsAgainstItsBudget(t *testing.T) {
	const k = 1 << 10
	b := newSendBudget(300*k, 200*k)
	q, other, third := newSendQueue(1000*k), newSendQueue(1000*k), newSendQueue(1000*k)
	b.join(q, "a")
	b.join(other, "b")
	b.join(third, "b")
	msg := func(n int) []byte { return make([]byte, n*k) }
	step := func(what string, got, want string) {
		t.Helper()
		if got != want {
			t.Fatalf("%s: %q, want %q", what, got, want)
		}
	}

	step("empty queue, 150 of a's 200", q.offer(msg(150)), "")
	step("a at 150 + 60", q.offer(msg(60)), "client")
	step("a at 150 + 40", q.offer(msg(40)), "")
	step("empty queue of b", other.offer(msg(100)), "")
	step("process at 290 + 20, b at 100", other.offer(msg(20)), "budget")
	step("another empty queue of b, past the budget", third.offer(msg(50)), "")
	step("a queue within sharedFloor, past the budget", third.offer(msg(10)), "")
	if ok, room, done := other.pushHalf(msg(20)); ok || done || room == nil {
		t.Fatalf("initial result past the budget: taken %v, done %v: want to wait for room", ok, done)
	}
	if !other.push(msg(1)) {
		t.Fatal("a reply was refused for the shared bounds; only its queue's bound applies")
	}
	if got := b.total.Load(); got != 351*k {
		t.Fatalf("total %d KiB, want 351", got/k)
	}

	// Written bytes leave the counts; a write finishing after release is not counted again.
	q.take(1 << 30)
	q.written(150 * k)
	if got, cq := b.total.Load(), b.clients["a"].bytes.Load(); got != 201*k || cq != 40*k {
		t.Fatalf("after 150 KiB written: total %d KiB (want 201), client a %d KiB (want 40)", got/k, cq/k)
	}
	q.release()
	q.written(40 * k)
	if got := b.total.Load(); got != 161*k {
		t.Fatalf("after a's release: total %d KiB, want 161", got/k)
	}
	if _, ok := b.clients["a"]; ok {
		t.Fatal("client a still listed with none of its queues left")
	}
	step("released queue", q.offer(msg(1)), "closed")
	other.closeWith(msg(5)) // drops the 101 queued, keeps the 5 of the last message
	if got := b.total.Load(); got != 65*k {
		t.Fatalf("after closeWith: total %d KiB, want 65", got/k)
	}
	other.release()
	other.release() // twice is harmless
	third.release()
	if got := b.total.Load(); got != 0 || len(b.clients) != 0 {
		t.Fatalf("all released: total %d, clients %d", got, len(b.clients))
	}
}
