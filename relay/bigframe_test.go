package relay

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// An event that fits the incoming frame limit can take about twice that going out (U+2028 is 3
// bytes as received and the 6 of \u2028 as the relay writes it). With the send queue as small as
// the frame limit (what validation allows), it still reaches a subscriber with nothing queued,
// instead of closing it as a slow reader: one published event must not disconnect everyone who
// subscribed to it.
func TestEventLargerOutgoingThanTheQueueReachesTheSubscriber(t *testing.T) {
	tr := startRelay(t, func(c *Config) {
		c.MaxMessageLength = 64 << 10
		c.SendQueueBytes = 64 << 10
	})
	sk, pk := testenv.NewKey()
	sub := tr.dial(t)
	sub.req("s", nostr.Filter{Authors: []string{pk}})

	ev := signed(sk, 1, strings.Repeat("\u2028", 21000), nostr.Now())
	// Sent as a client may send it: the separators raw (Go's encoder would escape them).
	frame, err := json.Marshal([]any{"EVENT", ev})
	if err != nil {
		t.Fatal(err)
	}
	frame = bytes.ReplaceAll(frame, []byte(`\u2028`), []byte("\u2028"))
	if len(frame) > 64<<10 {
		t.Fatalf("test premise: the EVENT frame is %d bytes, over the limit", len(frame))
	}
	pub := tr.dial(t)
	pub.sendRaw(frame)
	if r := parseOK(t, pub.expect("OK")); !r.ok {
		t.Fatalf("publish: %s", r.msg)
	}
	if out := len(eventMessage(eventPrefix("s"), eventJSON(&ev))); out <= 64<<10 {
		t.Fatalf("test premise: the outgoing EVENT is %d bytes, within the queue", out)
	}

	tr.s.DeliverEvent(publicDelivery(&ev)) // what the replication tail hands over
	m := sub.read()
	if sub.verb(m) != "EVENT" || str(m[1]) != "s" {
		t.Fatalf("subscriber got %.200s, want the EVENT", joinRaw(m))
	}
	var got nostr.Event
	if err := json.Unmarshal(m[2], &got); err != nil || got.ID != ev.ID || got.Content != ev.Content {
		t.Fatalf("subscriber got event %s (%v), want %s", got.ID, err, ev.ID)
	}
	if ok, _ := got.CheckSignature(); !ok {
		t.Fatal("the event as sent does not verify")
	}
	alive(t, sub)
	// And as an initial row.
	sameIDs(t, "REQ", sub.req("again", nostr.Filter{IDs: []string{ev.ID}}), ev)
}

// push: an empty queue takes one message larger than the bound; a queue holding anything does
// not take one that would go over it.
func TestSendQueuePushTakesOneLargeMessageWhenEmpty(t *testing.T) {
	q := newSendQueue(100)
	big := bytes.Repeat([]byte{'b'}, 250)
	if !q.push(big) {
		t.Fatal("an empty queue refused a message larger than its bound")
	}
	if q.push([]byte("x")) {
		t.Fatal("a queue over its bound took more")
	}
	q.written(len(q.take(1 << 20)[0]))
	if !q.push([]byte("small")) || q.push(big) {
		t.Fatal("a queue holding a message must refuse one that goes over the bound, and take one that fits")
	}
}

// Any frame over the limit ends in close 1009, however far over it is. A 10 MB frame is still
// being written when the relay sends its close frame from the header: closing the socket on the
// rest of it made the kernel answer with a reset, which cut the client's write short and which
// most clients report as 1006 (abnormal closure), whatever close frame came before it.
func TestHugeFrameClosesWith1009(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	frame := []byte(`["EVENT",{"content":"` + strings.Repeat("x", 10<<20) + `"}]`)
	if err := c.ws.WriteMessage(websocket.TextMessage, frame); err != nil {
		t.Fatalf("writing the 10 MB frame: %v (want it taken and discarded, not reset)", err)
	}
	c.expectClose1009(t, "10 MB frame")
	tr.expectTornDown(t, "message too big")
	alive(t, tr.dial(t))
}
