package relay

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// storeBigRows inserts n public kind-1 rows of pk with content of size bytes each, in one
// transaction, like storeRows.
func storeBigRows(t *testing.T, tr *testRelay, pk string, n, size int) {
	t.Helper()
	base := int64(nostr.Now()) - int64(n) - 10
	if _, err := tr.pool.Exec(context.Background(), `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		SELECT md5($1 || i || clock_timestamp()) || md5(i || $1), $1, $2 + i, 1, '[]', repeat('k', $4), repeat('0', 128)
		  FROM generate_series(1, $3) i`, pk, base, n, size); err != nil {
		t.Fatal(err)
	}
}

// A client that reads a long answer steadily, slower than one read deadline per answer but never
// stalling, and sends nothing of its own (a browser only answers pings) keeps its connection. The
// send queue stays non-empty for the whole answer (runInitial refills it as the writer drains it),
// so the writer never goes back to its idle select; the server's keepalive must still go out
// between batches, and the bytes the client takes show it is alive.
func TestSlowSteadyReaderKeepsItsConnectionThroughALongAnswer(t *testing.T) {
	tr := startRelay(t, func(c *Config) {
		// Half the queue (what an answer fills) holds two write batches: the queue never runs dry
		// while rows remain.
		c.SendQueueBytes = 4 * writeBatch
	})
	tr.s.readWait = time.Second
	tr.s.pingEvery = 300 * time.Millisecond
	_, pk := testenv.NewKey()
	const rows, size = 600, 4000 // ~2.5 MB: about three seconds at the client's pace below
	storeBigRows(t, tr, pk, rows, size)

	c, ws := tr.dialThrottled(t)
	pings := 0
	ws.SetPingHandler(func(data string) error { // what gorilla does by default, counted
		pings++
		return ws.WriteControl(websocket.PongMessage, []byte(data), time.Now().Add(time.Second))
	})
	start := time.Now()
	c.sendJSON("REQ", "long", nostr.Filter{Authors: []string{pk}, Limit: rows})
	// Read steadily at about 800 KB/s (pacing, not ordering: 16 KiB then 20 ms), never sending.
	got, read := 0, 0
	for {
		_ = ws.SetReadDeadline(time.Now().Add(readTimeout))
		_, b, err := ws.ReadMessage()
		if err != nil {
			t.Fatalf("after %d of %d events (%s): %v", got, rows, time.Since(start).Round(time.Millisecond), err)
		}
		read += len(b)
		if read >= 16<<10 {
			read = 0
			time.Sleep(20 * time.Millisecond)
		}
		var m []json.RawMessage
		if err := json.Unmarshal(b, &m); err != nil || len(m) == 0 {
			t.Fatalf("relay sent %q", b)
		}
		if c.verb(m) == "EVENT" {
			got++
			continue
		}
		if c.verb(m) == "EOSE" {
			break
		}
		t.Fatalf("unexpected %s", joinRaw(m))
	}
	if got != rows {
		t.Fatalf("%d events before EOSE, want %d", got, rows)
	}
	if took := time.Since(start); took < 2*tr.s.readWait {
		t.Fatalf("test premise: the answer took %s, not several read deadlines", took)
	}
	if pings == 0 {
		t.Fatal("the relay sent no keepalive ping during the answer")
	}
	select {
	case cc := <-tr.closed:
		t.Fatalf("connection closed: %s", cc.reason)
	default:
	}
}

// A client that stopped reading (a hung app, a phone gone without a reset) and never answers a
// ping is still closed at the read deadline although live events trickle to it: each small write
// only fills kernel buffers, proves nothing, and must not renew the deadline.
func TestSilentClientIsClosedThoughEventsTrickleToIt(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.readWait = 500 * time.Millisecond
	tr.s.pingEvery = 100 * time.Millisecond
	sk, pk := testenv.NewKey()
	c := tr.dial(t)
	c.sendJSON("REQ", "trickle", nostr.Filter{Authors: []string{pk}, Limit: 0, LimitZero: true})
	// From here on the client reads nothing, so it answers no ping either.
	deadline := time.Now().Add(10 * time.Second)
	base := int64(nostr.Now())
	for i := 0; time.Now().Before(deadline); i++ {
		ev := signed(sk, 1, "trickle", nostr.Timestamp(base+int64(i)))
		tr.s.DeliverEvent(publicDelivery(&ev))
		select {
		case cc := <-tr.closed:
			if i == 0 {
				t.Fatalf("closed before any event: %s", cc.reason)
			}
			return // closed at the read deadline, as a silent client should be
		case <-time.After(50 * time.Millisecond): // the trickle's pace, not an ordering
		}
	}
	t.Fatal("a client that read nothing and answered no ping for 10 s (read deadline 500 ms) is still connected")
}
