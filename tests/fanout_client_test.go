package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// fanClient is a minimal NIP-01/42 client with the control fan-out tests need: it can pipeline
// EVENTs (a benchmark must not wait for each OK), answer the AUTH challenge it has actually
// received, and count every EVENT per subscription (so a duplicate is visible, not absorbed).
type fanClient struct {
	t    testing.TB
	url  string
	conn *websocket.Conn
	wmu  sync.Mutex

	mu        sync.Mutex
	cond      *sync.Cond
	challenge string
	oks       map[string]fanOK
	subs      map[string]*fanSub
	closedErr error
	onEvent   func(sub string, ev *nostr.Event, at time.Time)    // optional, called on the reader goroutine
	onOK      func(id string, ok bool, msg string, at time.Time) // optional, likewise
}

type fanOK struct {
	ok  bool
	msg string
}

type fanSub struct {
	id     string
	events []*nostr.Event
	count  map[string]int
	eose   bool
	closed string
}

func fanDial(t testing.TB, url string) *fanClient {
	t.Helper()
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	conn, _, err := d.Dial(url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	conn.SetReadLimit(1 << 22)
	c := &fanClient{t: t, url: url, conn: conn, oks: map[string]fanOK{}, subs: map[string]*fanSub{}}
	c.cond = sync.NewCond(&c.mu)
	go c.read()
	t.Cleanup(func() { conn.Close() })
	return c
}

func (c *fanClient) read() {
	for {
		_, data, err := c.conn.ReadMessage()
		now := time.Now()
		if err != nil {
			c.mu.Lock()
			c.closedErr = err
			c.cond.Broadcast()
			c.mu.Unlock()
			return
		}
		var msg []json.RawMessage
		if json.Unmarshal(data, &msg) != nil || len(msg) < 2 {
			continue
		}
		var typ string
		_ = json.Unmarshal(msg[0], &typ)
		c.mu.Lock()
		switch typ {
		case "AUTH":
			_ = json.Unmarshal(msg[1], &c.challenge)
		case "OK":
			if len(msg) >= 4 {
				var id, m string
				var ok bool
				_ = json.Unmarshal(msg[1], &id)
				_ = json.Unmarshal(msg[2], &ok)
				_ = json.Unmarshal(msg[3], &m)
				c.oks[id] = fanOK{ok, m}
				if c.onOK != nil {
					c.mu.Unlock()
					c.onOK(id, ok, m, now)
					c.mu.Lock()
				}
			}
		case "EVENT":
			if len(msg) >= 3 {
				var sid string
				_ = json.Unmarshal(msg[1], &sid)
				ev := &nostr.Event{}
				if ev.UnmarshalJSON(msg[2]) == nil {
					if s := c.subs[sid]; s != nil {
						s.events = append(s.events, ev)
						s.count[ev.ID]++
					}
					if c.onEvent != nil {
						c.mu.Unlock()
						c.onEvent(sid, ev, now)
						c.mu.Lock()
					}
				}
			}
		case "EOSE":
			var sid string
			_ = json.Unmarshal(msg[1], &sid)
			if s := c.subs[sid]; s != nil {
				s.eose = true
			}
		case "CLOSED":
			var sid, m string
			_ = json.Unmarshal(msg[1], &sid)
			if len(msg) >= 3 {
				_ = json.Unmarshal(msg[2], &m)
			}
			if s := c.subs[sid]; s != nil {
				s.closed = "closed: " + m
			}
		}
		c.cond.Broadcast()
		c.mu.Unlock()
	}
}

func (c *fanClient) send(v any) {
	c.t.Helper()
	b, _ := json.Marshal(v)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.conn.WriteMessage(websocket.TextMessage, b); err != nil {
		c.t.Errorf("write to %s: %v", c.url, err)
	}
}

// waitFor waits until cond (called with c.mu held) holds; the deadline only turns a hang into a
// failure.
func (c *fanClient) waitFor(what string, timeout time.Duration, cond func() bool) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { c.mu.Lock(); c.cond.Broadcast(); c.mu.Unlock() })
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for !cond() {
		if c.closedErr != nil {
			c.t.Fatalf("%s: connection to %s closed: %v", what, c.url, c.closedErr)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: timed out after %s on %s", what, timeout, c.url)
		}
		c.cond.Wait()
	}
}

// sendEvent sends an EVENT without waiting for its OK.
func (c *fanClient) sendEvent(ev *nostr.Event) { c.send([]any{"EVENT", ev}) }

// publish sends an EVENT and returns its OK.
func (c *fanClient) publish(ev *nostr.Event) fanOK {
	c.t.Helper()
	c.sendEvent(ev)
	var r fanOK
	c.waitFor("OK for "+ev.ID, 20*time.Second, func() bool { var ok bool; r, ok = c.oks[ev.ID]; return ok })
	return r
}

func (c *fanClient) mustPublish(ev *nostr.Event) string {
	c.t.Helper()
	r := c.publish(ev)
	if !r.ok {
		c.t.Fatalf("publish kind %d on %s refused: %s", ev.Kind, c.url, r.msg)
	}
	return r.msg
}

// auth answers the relay's NIP-42 challenge as u.
func (c *fanClient) auth(u fanUser) {
	c.t.Helper()
	var ch string
	c.waitFor("AUTH challenge", 10*time.Second, func() bool { ch = c.challenge; return ch != "" })
	ev := &nostr.Event{Kind: 22242, CreatedAt: nostr.Now(), Tags: nostr.Tags{{"relay", c.url}, {"challenge", ch}}}
	if err := ev.Sign(u.sk); err != nil {
		c.t.Fatal(err)
	}
	c.send([]any{"AUTH", ev})
	var r fanOK
	c.waitFor("AUTH OK", 10*time.Second, func() bool { var ok bool; r, ok = c.oks[ev.ID]; return ok })
	if !r.ok {
		c.t.Fatalf("AUTH refused by %s: %s", c.url, r.msg)
	}
}

var fanSubSeq atomic.Int64

// subscribe opens a subscription and waits for its EOSE: from then on, live delivery is on.
func (c *fanClient) subscribe(filters ...nostr.Filter) *fanSub {
	c.t.Helper()
	id := fmt.Sprintf("s%d", fanSubSeq.Add(1))
	s := &fanSub{id: id, count: map[string]int{}}
	c.mu.Lock()
	c.subs[id] = s
	c.mu.Unlock()
	msg := []any{"REQ", id}
	for _, f := range filters {
		msg = append(msg, f)
	}
	c.send(msg)
	c.waitFor("EOSE of "+id, 20*time.Second, func() bool { return s.eose || s.closed != "" })
	if s.closed != "" {
		c.t.Fatalf("subscription %s on %s %s", id, c.url, s.closed)
	}
	return s
}

// waitEvents waits until sub has received every id.
func (c *fanClient) waitEvents(s *fanSub, timeout time.Duration, ids ...string) {
	c.t.Helper()
	c.waitFor(fmt.Sprintf("%d events on %s", len(ids), s.id), timeout, func() bool {
		for _, id := range ids {
			if s.count[id] == 0 {
				return false
			}
		}
		return true
	})
}

// counts returns how often each id arrived on sub.
func (c *fanClient) counts(s *fanSub) map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := make(map[string]int, len(s.count))
	for k, v := range s.count {
		m[k] = v
	}
	return m
}

type fanUser struct{ sk, pk string }

func newFanUser() fanUser { sk, pk := testenv.NewKey(); return fanUser{sk, pk} }

var fanNonce atomic.Int64

// event signs a new event; a nonce tag keeps events distinct within one second.
func (u fanUser) event(kind int, content string, tags ...nostr.Tag) *nostr.Event {
	all := append(nostr.Tags{}, tags...)
	all = append(all, nostr.Tag{"nonce", fmt.Sprint(fanNonce.Add(1))})
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: all, Content: content}
	if err := ev.Sign(u.sk); err != nil {
		panic(err)
	}
	return ev
}

// fanPsqlAccept stores ev the way an operator does from psql.
func fanPsqlAccept(t testing.TB, dbURL string, ev *nostr.Event) {
	t.Helper()
	b, _ := json.Marshal(ev)
	pool := testenv.Pool(t, dbURL)
	var ok bool
	var msg string
	if err := pool.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(b)).Scan(&ok, &msg); err != nil || !ok {
		t.Fatalf("accept_event from SQL: %v %v %q", err, ok, msg)
	}
}
