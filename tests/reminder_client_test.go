package tests

import (
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
)

// remClient is a minimal NIP-01/42 client for the reminder tests: it authenticates, opens one
// subscription and counts every EVENT on it per id, with the arrival time of the first one.
type remClient struct {
	t    testing.TB
	url  string
	conn *websocket.Conn
	wmu  sync.Mutex

	mu        sync.Mutex
	cond      *sync.Cond
	challenge string
	oks       map[string]string // id -> "" (ok) or the refusal message
	eose      map[string]bool
	count     map[string]int       // event id -> EVENTs received (all subscriptions)
	first     map[string]time.Time // event id -> first arrival
	closed    error
}

func remDial(t testing.TB, url string) *remClient {
	t.Helper()
	conn, _, err := (&websocket.Dialer{HandshakeTimeout: 10 * time.Second}).Dial(url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	conn.SetReadLimit(1 << 22)
	c := &remClient{t: t, url: url, conn: conn, oks: map[string]string{}, eose: map[string]bool{},
		count: map[string]int{}, first: map[string]time.Time{}}
	c.cond = sync.NewCond(&c.mu)
	go c.read()
	t.Cleanup(func() { conn.Close() })
	return c
}

func (c *remClient) read() {
	for {
		_, data, err := c.conn.ReadMessage()
		now := time.Now()
		c.mu.Lock()
		if err != nil {
			c.closed = err
			c.cond.Broadcast()
			c.mu.Unlock()
			return
		}
		var msg []json.RawMessage
		var typ string
		if json.Unmarshal(data, &msg) == nil && len(msg) >= 2 && json.Unmarshal(msg[0], &typ) == nil {
			switch typ {
			case "AUTH":
				_ = json.Unmarshal(msg[1], &c.challenge)
			case "OK":
				var id, m string
				var ok bool
				if len(msg) >= 4 {
					_ = json.Unmarshal(msg[1], &id)
					_ = json.Unmarshal(msg[2], &ok)
					_ = json.Unmarshal(msg[3], &m)
					if ok {
						m = ""
					} else if m == "" {
						m = "refused"
					}
					c.oks[id] = m
				}
			case "EOSE":
				var sid string
				_ = json.Unmarshal(msg[1], &sid)
				c.eose[sid] = true
			case "CLOSED":
				var sid string
				_ = json.Unmarshal(msg[1], &sid)
				c.eose[sid] = true
				c.t.Errorf("subscription %s closed by %s: %s", sid, c.url, data)
			case "EVENT":
				var ev nostr.Event
				if len(msg) >= 3 && json.Unmarshal(msg[2], &ev) == nil {
					if ok, _ := ev.CheckSignature(); !ok {
						c.t.Errorf("event %s from %s has a bad signature", ev.ID, c.url)
					}
					if c.count[ev.ID] == 0 {
						c.first[ev.ID] = now
					}
					c.count[ev.ID]++
				}
			}
		}
		c.cond.Broadcast()
		c.mu.Unlock()
	}
}

func (c *remClient) send(v ...any) {
	c.t.Helper()
	b, _ := json.Marshal(v)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.conn.WriteMessage(websocket.TextMessage, b); err != nil {
		c.t.Fatalf("write %s: %v", c.url, err)
	}
}

// wait waits until cond (called under c.mu) holds; the deadline turns a hang into a failure.
func (c *remClient) wait(what string, timeout time.Duration, cond func() bool) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { c.mu.Lock(); c.cond.Broadcast(); c.mu.Unlock() })
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for !cond() {
		if c.closed != nil {
			c.t.Fatalf("%s: connection %s closed: %v", what, c.url, c.closed)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: timed out after %s", what, timeout)
		}
		c.cond.Wait()
	}
}

// auth answers the relay's NIP-42 challenge as sk.
func (c *remClient) auth(sk string) {
	c.t.Helper()
	var ch string
	c.wait("AUTH challenge", 10*time.Second, func() bool { ch = c.challenge; return ch != "" })
	ev := &nostr.Event{Kind: 22242, CreatedAt: nostr.Now(), Tags: nostr.Tags{{"relay", c.url}, {"challenge", ch}}}
	if err := ev.Sign(sk); err != nil {
		c.t.Fatal(err)
	}
	c.send("AUTH", ev)
	var res string
	c.wait("AUTH OK", 10*time.Second, func() bool { var ok bool; res, ok = c.oks[ev.ID]; return ok })
	if res != "" {
		c.t.Fatalf("AUTH refused by %s: %s", c.url, res)
	}
}

var remSubSeq sync.Mutex
var remSubN int

// subscribeDue subscribes to the author's reminders with since far in the future: stored events
// never match it, but due signals do (they match ignoring since/until), so every EVENT counted
// afterwards is a due delivery.
func (c *remClient) subscribeDue(author string) {
	c.t.Helper()
	remSubSeq.Lock()
	remSubN++
	id := fmt.Sprint("due", remSubN)
	remSubSeq.Unlock()
	since := nostr.Timestamp(time.Now().Unix() + 10*365*24*3600)
	c.send("REQ", id, nostr.Filter{Kinds: []int{30300}, Authors: []string{author}, Since: &since})
	c.wait("EOSE "+id, 20*time.Second, func() bool { return c.eose[id] })
}

func (c *remClient) counts() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := make(map[string]int, len(c.count))
	for k, v := range c.count {
		m[k] = v
	}
	return m
}
