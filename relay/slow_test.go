package relay

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// smallReceiveBuffer is a net.Dialer Control that gives the socket a 4 KiB receive buffer.
func smallReceiveBuffer(network, address string, rc syscall.RawConn) error {
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
	}); err != nil {
		return err
	}
	return serr
}

// dialSmallBuffer dials with a tiny socket receive buffer, so a client that stops reading makes
// the server's socket fill quickly (the kernel would otherwise buffer megabytes).
func (tr *testRelay) dialSmallBuffer(t *testing.T) *websocket.Conn {
	t.Helper()
	d := websocket.Dialer{NetDialContext: (&net.Dialer{Control: smallReceiveBuffer}).DialContext}
	ws, _, err := d.Dial(tr.url, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	return ws
}

// dialThrottled dials like dialSmallBuffer and gives the relay's side of the connection a small
// send buffer too (no autotuning), so an answer cannot sit in kernel buffers: the relay's writer
// moves only as fast as the client reads. It reads the AUTH challenge.
func (tr *testRelay) dialThrottled(t *testing.T) (*client, *websocket.Conn) {
	t.Helper()
	ws := tr.dialSmallBuffer(t)
	c := &client{t: t, ws: ws}
	c.expect("AUTH")
	var newest *conn
	for _, sc := range tr.s.snapshotConns() {
		if newest == nil || sc.id > newest.id {
			newest = sc
		}
	}
	if err := newest.ws.NetConn().(*net.TCPConn).SetWriteBuffer(4096); err != nil {
		t.Fatal(err)
	}
	return c, ws
}

// TestSlowReaderClosed: a subscriber that never reads is closed when its send queue overflows,
// while Deliver never blocks and another subscriber receives every event.
func TestSlowReaderClosed(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.SendQueueBytes = 256 << 10 })
	sk, pk := testenv.NewKey()
	filter := nostr.Filter{Authors: []string{pk}, Limit: 1}

	slow := tr.dialSmallBuffer(t)
	slowClient := &client{t: t, ws: slow}
	slowClient.expect("AUTH")
	slowClient.sendJSON("REQ", "s", filter)
	slowClient.expect("EOSE")
	// From here on the slow client never reads.

	fast := tr.dial(t)
	fast.req("s", filter)
	got := make(chan string, 1)
	readErr := make(chan error, 1)
	go func() {
		for {
			m, err := fast.tryRead(30 * time.Second)
			if err != nil {
				readErr <- err
				return
			}
			if fast.verb(m) == "EVENT" {
				var ev nostr.Event
				_ = json.Unmarshal(m[2], &ev)
				got <- ev.ID
			}
		}
	}()

	content := strings.Repeat("x", 32<<10)
	const n = 600 // ~20 MB: far beyond socket buffers plus the 256 KiB queue
	var slowGone closedConn
	closedSeen := false
	for i := 0; i < n; i++ {
		ev := signed(sk, 1, content, nostr.Timestamp(int64(nostr.Now())+int64(i)))
		start := time.Now()
		tr.s.DeliverEvent(publicDelivery(&ev))
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("Deliver blocked for %s", d)
		}
		// Pace by the fast reader (a barrier, not a sleep): it must get every event.
		select {
		case id := <-got:
			if id != ev.ID {
				t.Fatalf("fast reader got %s, want %s", id, ev.ID)
			}
		case err := <-readErr:
			t.Fatalf("fast reader failed at %d: %v", i, err)
		}
		select {
		case cc := <-tr.closed:
			slowGone, closedSeen = cc, true
		default:
		}
	}
	if !closedSeen {
		select {
		case cc := <-tr.closed:
			slowGone = cc
		case <-time.After(30 * time.Second):
			t.Fatal("slow reader was not closed")
		}
	}
	if slowGone.reason != "send queue overflow" {
		t.Fatalf("closed connection reason %q", slowGone.reason)
	}
	if tr.s.ConnCount() != 1 {
		t.Fatalf("%d connections left, want the fast one", tr.s.ConnCount())
	}
	// The slow client finds its connection ended once it reads what was buffered.
	for {
		_ = slow.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, _, err := slow.ReadMessage(); err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("slow client's connection still open")
			}
			break
		}
	}
}

func TestShutdown(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	c.req("s", nostr.Filter{Kinds: []int{1}, Limit: 1})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- tr.s.Shutdown(ctx) }()
	sawNotice := false
	for {
		m, err := c.tryRead(readTimeout)
		if err != nil {
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != websocket.CloseGoingAway {
				t.Fatalf("want close 1001, got %v", err)
			}
			break
		}
		if c.verb(m) == "NOTICE" {
			sawNotice = true
		}
	}
	if !sawNotice {
		t.Error("no NOTICE before the close frame")
	}
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if _, resp, err := websocket.DefaultDialer.Dial(tr.url, nil); err == nil || resp == nil || resp.StatusCode != 503 {
		t.Fatalf("new connection after shutdown: %v", err)
	}
}

// TestShutdownDoesNotWaitForAStuckConnection: a connection goroutine that does not return once its
// socket is closed (a bug, simulated here by a WaitGroup count nobody gives back) costs Shutdown
// KillWait past its context, not forever: the process's shutdown bound depends on it.
func TestShutdownDoesNotWaitForAStuckConnection(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	c.req("s", nostr.Filter{Kinds: []int{1}, Limit: 1})
	tr.s.connWG.Add(1) // the stuck goroutine
	released := false
	release := func() {
		if !released {
			released = true
			tr.s.connWG.Done()
		}
	}
	t.Cleanup(release)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- tr.s.Shutdown(ctx) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "still running") {
			t.Fatalf("Shutdown with a stuck connection: %v, want the deadline and the count of connections still running", err)
		}
	case <-time.After(KillWait + 10*time.Second): // a bound check, not a timing: KillWait is the promise
		release()
		<-done
		t.Fatalf("Shutdown waited for a stuck connection %s past its context (KillWait is %s)", KillWait+10*time.Second, KillWait)
	}
	// The real connection was closed all the same (a read timeout is not a close).
	for i := 0; ; i++ {
		_, err := c.tryRead(readTimeout)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatal("the connection stayed open after Shutdown")
		}
		if err != nil {
			break
		}
		if i > 100 {
			t.Fatal("the connection kept sending after Shutdown")
		}
	}
}

// TestLargeInitialAnswerIsFlowControlled: an initial answer several times the send queue bound
// waits for the client instead of overflowing it (only live traffic can make a client "slow").
func TestLargeInitialAnswerIsFlowControlled(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.SendQueueBytes = 256 << 10 })
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	content := strings.Repeat("y", 16<<10)
	base := int64(nostr.Now()) - 1000
	var want []nostr.Event
	for i := 0; i < 60; i++ { // ~1 MB, four times the queue bound
		ev := signed(sk, 1, content, nostr.Timestamp(base+int64(i)))
		c.mustPublish(ev)
		want = append([]nostr.Event{ev}, want...)
	}
	sameIDs(t, "large answer", c.req("big", nostr.Filter{Authors: []string{pk}}), want...)
	alive(t, c)
}

// TestClientPingsDoNotCutABlockedWrite: a client that pings while it is slow to read keeps its
// connection. The relay answers pings from the write loop; a pong written from the read loop would
// reset the socket's write deadline to gorilla's 1 s under a batch blocked on the slow reader, and
// the connection would die as "write: i/o timeout" well inside the 10 s write budget.
func TestClientPingsDoNotCutABlockedWrite(t *testing.T) {
	tr := startRelay(t, nil)
	pub := tr.dial(t)
	sk, pk := testenv.NewKey()
	content := strings.Repeat("p", 16<<10)
	base := int64(nostr.Now()) - 1000
	var want []nostr.Event
	for i := 0; i < 64; i++ { // ~1 MB: far beyond what a 4 KiB receive window lets through
		ev := signed(sk, 1, content, nostr.Timestamp(base+int64(i)))
		pub.mustPublish(ev)
		want = append([]nostr.Event{ev}, want...)
	}

	c, ws := tr.dialThrottled(t)
	c.sendJSON("REQ", "big", nostr.Filter{Authors: []string{pk}})
	// Read nothing for 3 s (the scenario: a slow link) while pinging every 100 ms, as clients
	// with keep-alives do; the relay's writer is blocked on the full socket meanwhile.
	pongs := 0
	ws.SetPongHandler(func(string) error { pongs++; return nil })
	for i := 0; i < 30; i++ {
		if err := ws.WriteControl(websocket.PingMessage, []byte("k"), time.Now().Add(time.Second)); err != nil {
			t.Fatalf("ping %d: %v", i, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	got, closed := c.collect("big")
	if closed != "" {
		t.Fatalf("CLOSED %q", closed)
	}
	sameIDs(t, "answer read after the pause", got, want...)
	select {
	case cc := <-tr.closed:
		t.Fatalf("connection closed: %s", cc.reason)
	default:
	}
	alive(t, c)
	if pongs == 0 {
		t.Fatal("no pong came back")
	}
}

// A client that asks for a large answer and does not read it is ended by the write deadline, not
// by a queue overflow (initial rows wait for room instead): that is counted and logged as a slow
// client too (buzz_slow_clients_closed_total{reason="write_timeout"}); before, only overflows were.
func TestSlowREQReaderIsCountedWhenItsWriteTimesOut(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.writeWait = time.Second
	pub := tr.dial(t)
	sk, pk := testenv.NewKey()
	content := strings.Repeat("w", 16<<10)
	base := int64(nostr.Now()) - 1000
	for i := 0; i < 64; i++ { // ~1 MB: far beyond a 4 KiB socket buffer
		pub.mustPublish(signed(sk, 1, content, nostr.Timestamp(base+int64(i))))
	}
	timeouts := func() float64 { return testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues("write_timeout")) }
	overflows := func() float64 { return testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues("overflow")) }
	t0, o0 := timeouts(), overflows()
	c, _ := tr.dialThrottled(t)
	c.sendJSON("REQ", "big", nostr.Filter{Authors: []string{pk}})
	// From here on the client reads nothing.
	select {
	case cc := <-tr.closed:
		if !strings.Contains(cc.reason, "i/o timeout") {
			t.Fatalf("closed for %q, want the write deadline", cc.reason)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the client that reads nothing was not closed")
	}
	if d := timeouts() - t0; d != 1 {
		t.Fatalf("write_timeout closes counted: %v, want 1", d)
	}
	if d := overflows() - o0; d != 0 {
		t.Fatalf("overflow closes counted: %v, want 0", d)
	}
	alive(t, pub)
}
