package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// newestConn is the relay's side of the connection dialled last.
func newestConn(tr *testRelay) *conn {
	var newest *conn
	for _, sc := range tr.s.snapshotConns() {
		if newest == nil || sc.id > newest.id {
			newest = sc
		}
	}
	return newest
}

// manySubsConfig: a queue that takes two copies of the large event below, not three.
func manySubsConfig(c *Config) {
	c.MaxMessageLength = 64 << 10
	c.SendQueueBytes = 128 << 10
}

const manySubs = 8

// subscribeMany opens manySubs subscriptions on c that all match pk's events.
func subscribeMany(c *client, pk string) []string {
	var subIDs []string
	for i := range manySubs {
		id := fmt.Sprintf("m%d", i)
		c.req(id, nostr.Filter{Authors: []string{pk}})
		subIDs = append(subIDs, id)
	}
	return subIDs
}

// One large event matching several subscriptions of a client reaches each of them, and the client
// stays connected: each subscription's copy differs (its frame names the subscription), so the
// copies together can be several times the send queue while one fits it easily. The client reads
// only after Deliver has returned, which is what any reader looks like at that moment (the copies
// are queued in microseconds, faster than a socket takes one of them); on a throttled socket the
// writer's first batch stays counted until the client reads, so the test does not depend on how
// fast the writer is. Both the stored path and an ephemeral event, which is fanned out the same way.
func TestOneLargeEventReachesEveryMatchingSubscription(t *testing.T) {
	tr := startRelay(t, manySubsConfig)
	sk, pk := testenv.NewKey()
	c, _ := tr.dialThrottled(t)
	subIDs := subscribeMany(c, pk)

	for _, kind := range []int{1, 20001} {
		ev := signed(sk, kind, strings.Repeat("x", 60000), nostr.Now())
		one := len(eventMessage(eventPrefix(subIDs[0]), eventJSON(&ev)))
		if one > tr.s.cfg.SendQueueBytes || manySubs*one <= 2*tr.s.cfg.SendQueueBytes {
			t.Fatalf("test premise: one copy is %d bytes, the queue %d", one, tr.s.cfg.SendQueueBytes)
		}
		tr.s.DeliverEvent(publicDelivery(&ev))
		got := map[string]bool{}
		for len(got) < manySubs {
			m, err := c.tryRead(readTimeout)
			if err != nil {
				t.Fatalf("kind %d: after %d of %d copies: %v", kind, len(got), manySubs, err)
			}
			if c.verb(m) != "EVENT" {
				t.Fatalf("kind %d: after %d of %d copies, got %.200s", kind, len(got), manySubs, joinRaw(m))
			}
			var e nostr.Event
			if err := json.Unmarshal(m[2], &e); err != nil || e.ID != ev.ID {
				t.Fatalf("kind %d: got event %s (%v), want %s", kind, e.ID, err, ev.ID)
			}
			sub := str(m[1])
			if got[sub] {
				t.Fatalf("kind %d: subscription %s got the event twice", kind, sub)
			}
			got[sub] = true
		}
		// Also makes sure the writer has finished with the copies before the next event.
		alive(t, c)
	}
	select {
	case cc := <-tr.closed:
		t.Fatalf("connection closed: %s", cc.reason)
	default:
	}
}

// A client with many matching subscriptions that stops reading is still closed as a slow reader,
// on the next event once its queue is over the bound, even while an initial answer waits for room
// (pushHalf): a unit of copies is admitted only while one copy fits, so the queue never holds more
// than the bound plus one copy per subscription.
func TestReaderThatStopsIsClosedDespiteManySubscriptions(t *testing.T) {
	tr := startRelay(t, manySubsConfig)
	sk, pk := testenv.NewKey()
	_, oldPK := testenv.NewKey()
	storeBigRows(t, tr, oldPK, 200, 4000) // ~800 KB: six times the queue
	c, _ := tr.dialThrottled(t)
	sc := newestConn(tr)
	subscribeMany(c, pk)
	// From here on the client reads nothing.
	c.sendJSON("REQ", "old", nostr.Filter{Authors: []string{oldPK}, Limit: 200})
	// Wait (a state, not a time) until the answer has filled the half of the queue it may fill and
	// waits for room: the writer is stuck on the full socket.
	deadline := time.Now().Add(readTimeout)
	for {
		sc.q.mu.Lock()
		waiting, size := sc.q.waiting, sc.q.size
		sc.q.mu.Unlock()
		if waiting {
			if size > sc.q.limit/2 {
				t.Fatalf("the initial answer holds %d bytes, over half the queue", size)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the initial answer never waited for room")
		}
		time.Sleep(5 * time.Millisecond)
	}

	limit := tr.s.cfg.SendQueueBytes
	for i := 1; ; i++ {
		ev := signed(sk, 1, strings.Repeat("x", 60000), nostr.Timestamp(int64(nostr.Now())+int64(i)))
		one := len(eventMessage(eventPrefix("m0"), eventJSON(&ev)))
		tr.s.DeliverEvent(publicDelivery(&ev))
		tr.s.drainInboxes()
		sc.q.mu.Lock()
		size, closed := sc.q.size, sc.q.closed
		sc.q.mu.Unlock()
		if size > limit+manySubs*one {
			t.Fatalf("event %d: the queue holds %d bytes, over the bound %d plus %d copies of %d", i, size, limit, manySubs, one)
		}
		if i == 1 && closed {
			t.Fatal("the first event closed the connection: its copies were refused though one fit")
		}
		if closed {
			if i != 2 {
				t.Fatalf("closed at event %d, want 2 (the first left the queue over its bound)", i)
			}
			break
		}
		if i > 2 {
			t.Fatal("a client that reads nothing was not closed")
		}
	}
	tr.expectTornDown(t, "send queue overflow")
}

// offer admits a unit of copies by push's rule for one of them, judged on the queue before it:
// an empty queue takes any unit; a queue holding something takes a unit whose largest copy fits,
// whatever the unit's total, and refuses one whose largest copy does not.
func TestSendQueueOfferAdmitsCopiesAsOne(t *testing.T) {
	copies := func(n, size int) [][]byte {
		var out [][]byte
		for i := range n {
			out = append(out, bytes.Repeat([]byte{byte('a' + i)}, size+i))
		}
		return out
	}
	q := newSendQueue(100)
	if q.offer(copies(5, 250)...) != "" {
		t.Fatal("an empty queue refused a unit")
	}
	if q.offer(copies(1, 1)...) == "" || q.push([]byte("x")) {
		t.Fatal("a queue over its bound took more")
	}
	for b := q.take(1 << 20); len(b) > 0; b = q.take(1 << 20) {
		for _, m := range b {
			q.written(len(m))
		}
	}
	if !q.push(bytes.Repeat([]byte{'s'}, 50)) {
		t.Fatal("an empty queue refused a small message")
	}
	if q.offer(copies(3, 49)...) == "" { // 49 and 50 fit in the 50 left, 51 does not
		t.Fatal("a unit whose largest copy does not fit was taken")
	}
	if q.offer(copies(4, 40)...) != "" { // 40..43 each fit alone; 166 together
		t.Fatal("a unit whose every copy fits alone was refused")
	}
	if q.size != 50+40+41+42+43 {
		t.Fatalf("%d bytes counted", q.size)
	}
	q.closeWith(nil)
	if q.offer(copies(1, 1)...) == "" {
		t.Fatal("a closed queue took a unit")
	}
}
