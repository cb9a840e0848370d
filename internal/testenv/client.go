package testenv

import (
	"bytes"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
)

// Client is the NIP-01/42 WebSocket client of the black-box tests. One reader goroutine records
// everything the relay sends: every OK per event id (a re-published event gets a second one), and
// every EVENT per subscription with a count per id, so a duplicate stays visible instead of being
// absorbed. The wait helpers block on that record; their deadlines only turn a hang into a failure.
//
// Methods that can fail the test must be called from the test's goroutine.
type Client struct {
	URL  string
	t    testing.TB
	conn *websocket.Conn
	wmu  sync.Mutex

	// Fixed at Dial (so the reader needs no lock to read them).
	strict  bool
	onEvent func(sub string, ev *nostr.Event, at time.Time)
	onOK    func(id string, ok bool, msg string, at time.Time)

	mu        sync.Mutex
	cond      *sync.Cond
	firstVerb string
	challenge string
	oks       map[string][]OK
	subs      map[string]*Sub
	readErr   error // why the reader stopped (the connection is gone)
}

// OK is the relay's answer to an EVENT or AUTH.
type OK struct {
	OK  bool
	Msg string
}

// ClientOption configures a Client at Dial.
type ClientOption func(*Client)

// OnEvent calls fn on the reader goroutine for every EVENT (benchmarks time arrivals with it).
func OnEvent(fn func(sub string, ev *nostr.Event, at time.Time)) ClientOption {
	return func(c *Client) { c.onEvent = fn }
}

// OnOK calls fn on the reader goroutine for every OK.
func OnOK(fn func(id string, ok bool, msg string, at time.Time)) ClientOption {
	return func(c *Client) { c.onOK = fn }
}

// Strict verifies the signature of every EVENT received and makes any CLOSED a test error: for
// tests whose subscriptions must never be closed by the relay.
func Strict() ClientOption { return func(c *Client) { c.strict = true } }

// Dial connects to a relay; the connection is closed at cleanup.
func Dial(t testing.TB, url string, opts ...ClientOption) *Client {
	t.Helper()
	conn, _, err := (&websocket.Dialer{HandshakeTimeout: 10 * time.Second}).Dial(url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	conn.SetReadLimit(1 << 22)
	c := &Client{URL: url, t: t, conn: conn, oks: map[string][]OK{}, subs: map[string]*Sub{}}
	c.cond = sync.NewCond(&c.mu)
	for _, o := range opts {
		o(c)
	}
	done := make(chan struct{})
	go func() { defer close(done); c.read() }()
	// The reader may report to t (Strict): it is stopped, and waited for, before the test ends,
	// so no frame is handled (and no t.Errorf called) after the test has completed.
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return c
}

func (c *Client) read() {
	for {
		_, data, err := c.conn.ReadMessage()
		at := time.Now()
		if err != nil {
			c.mu.Lock()
			c.readErr = err
			c.cond.Broadcast()
			c.mu.Unlock()
			return
		}
		var msg []json.RawMessage
		var verb, arg string
		var ev *nostr.Event
		if bytes.HasPrefix(data, []byte(`["EVENT",`)) {
			// The bulk of what a subscriber reads: one pass with go-nostr's envelope decoder
			// instead of a generic array decode followed by the event's own.
			var env nostr.EventEnvelope
			if env.UnmarshalJSON(data) != nil || env.SubscriptionID == nil {
				continue
			}
			verb, arg, ev = "EVENT", *env.SubscriptionID, &env.Event
		} else {
			if json.Unmarshal(data, &msg) != nil || len(msg) < 2 {
				continue
			}
			_ = json.Unmarshal(msg[0], &verb)
			_ = json.Unmarshal(msg[1], &arg) // challenge, event id or subscription id
		}
		if ev != nil {
			if c.strict {
				if ok, _ := ev.CheckSignature(); !ok {
					c.t.Errorf("event %s from %s has a bad signature", ev.ID, c.URL)
				}
			}
		}
		var ok OK
		c.mu.Lock()
		if c.firstVerb == "" {
			c.firstVerb = verb
		}
		switch verb {
		case "AUTH":
			c.challenge = arg
		case "OK":
			if len(msg) >= 4 {
				_ = json.Unmarshal(msg[2], &ok.OK)
				_ = json.Unmarshal(msg[3], &ok.Msg)
				c.oks[arg] = append(c.oks[arg], ok)
			}
		case "EVENT":
			if s := c.subs[arg]; s != nil && ev != nil {
				s.add(ev, at)
			}
		case "EOSE":
			if s := c.subs[arg]; s != nil {
				s.eose = true
			}
		case "CLOSED":
			if s := c.subs[arg]; s != nil {
				s.closed = true
				if len(msg) >= 3 {
					_ = json.Unmarshal(msg[2], &s.reason)
				}
			}
			if c.strict {
				c.t.Errorf("subscription %s closed by %s: %s", arg, c.URL, data)
			}
		}
		c.cond.Broadcast()
		c.mu.Unlock()
		// Hooks run without the lock, so they may call the client's accessors.
		if verb == "OK" && len(msg) >= 4 && c.onOK != nil {
			c.onOK(arg, ok.OK, ok.Msg, at)
		}
		if ev != nil && c.onEvent != nil {
			c.onEvent(arg, ev, at)
		}
	}
}
