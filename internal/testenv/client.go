package testenv

import (
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/wsclient"
)

// Client is the black-box tests' view of a wsclient connection. It records everything the relay
// sends: every OK per event id (a re-published event gets a second one), and every EVENT per
// subscription with a count per id, so a duplicate stays visible instead of being absorbed. The
// wait helpers block on that record; their deadlines only turn a hang into a failure.
//
// Methods that can fail the test must be called from the test's goroutine.
type Client struct {
	URL string
	t   testing.TB
	ws  *wsclient.Client

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
type OK = wsclient.OK

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
	c := &Client{URL: url, t: t, oks: map[string][]OK{}, subs: map[string]*Sub{}}
	c.cond = sync.NewCond(&c.mu)
	for _, o := range opts {
		o(c)
	}
	ws, err := wsclient.Dial(url, c.handlers(), 10*time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	c.ws = ws
	// The reader may report to t (Strict): it is stopped, and waited for, before the test ends,
	// so no frame is handled (and no t.Errorf called) after the test has completed.
	t.Cleanup(ws.Close)
	return c
}

// handlers record each frame; the caller's own hooks run after, without the lock, so they may
// call the client's accessors.
func (c *Client) handlers() wsclient.Handlers {
	return wsclient.Handlers{
		OnAuth: func(ch string, _ time.Time) { c.record("AUTH", func() { c.challenge = ch }) },
		OnOK: func(o OK) {
			c.record("OK", func() { c.oks[o.ID] = append(c.oks[o.ID], o) })
			if c.onOK != nil {
				c.onOK(o.ID, o.OK, o.Msg, o.At)
			}
		},
		OnEvent: func(sub string, ev *nostr.Event, at time.Time) {
			if c.strict {
				if ok, _ := ev.CheckSignature(); !ok {
					c.t.Errorf("event %s from %s has a bad signature", ev.ID, c.URL)
				}
			}
			c.record("EVENT", func() { c.sub(sub, func(s *Sub) { s.add(ev, at) }) })
			if c.onEvent != nil {
				c.onEvent(sub, ev, at)
			}
		},
		OnEOSE: func(sub string, _ time.Time) { c.record("EOSE", func() { c.sub(sub, func(s *Sub) { s.eose = true }) }) },
		OnClosed: func(sub, reason string, _ time.Time) {
			c.record("CLOSED", func() { c.sub(sub, func(s *Sub) { s.closed, s.reason = true, reason }) })
			if c.strict {
				c.t.Errorf("subscription %s closed by %s: %s", sub, c.URL, reason)
			}
		},
		OnNotice: func(string, time.Time) { c.record("NOTICE", func() {}) },
		OnEnd:    func(err error, _ time.Time) { c.record("", func() { c.readErr = err }) },
	}
}

// record runs fn under the lock, notes the first verb the relay sent, and wakes the waiters.
func (c *Client) record(verb string, fn func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.firstVerb == "" {
		c.firstVerb = verb
	}
	fn()
	c.cond.Broadcast()
}

// sub runs fn on subscription id if this client opened it (c.mu held).
func (c *Client) sub(id string, fn func(*Sub)) {
	if s := c.subs[id]; s != nil {
		fn(s)
	}
}
