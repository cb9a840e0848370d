package testenv

// What a test does on a Client: send, wait, publish, authenticate. Subscriptions are in client_sub.go.

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/wsclient"
)

// Send writes one message, e.g. Send("REQ", id, filter).
func (c *Client) Send(msg ...any) {
	c.t.Helper()
	b, err := json.Marshal(msg)
	if err != nil {
		c.t.Fatal(err)
	}
	c.SendRaw(b)
}

// SendRaw writes a text frame as given (for malformed or oversized input).
func (c *Client) SendRaw(b []byte) {
	c.t.Helper()
	if err := c.TrySendRaw(b); err != nil {
		c.t.Fatalf("write to %s: %v", c.URL, err)
	}
}

// TrySendRaw writes a text frame and returns the write's error: for a frame the relay may refuse
// while it is still being written (an oversized one is closed with 1009 from its header), which
// ends the write with the close instead of completing it.
func (c *Client) TrySendRaw(b []byte) error { return c.ws.WriteRaw(b) }

// waitFor waits until cond (called with c.mu held) holds, failing the test at the deadline or
// when the connection is gone first (nothing more can arrive then).
func (c *Client) waitFor(what string, timeout time.Duration, cond func() bool) {
	c.t.Helper()
	if err := c.await(timeout, cond); err != nil {
		c.t.Fatalf("%s: %v on %s", what, err, c.URL)
	}
}

// await returns nil once cond (called with c.mu held) holds, else why it cannot wait longer.
func (c *Client) await(timeout time.Duration, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { c.mu.Lock(); c.cond.Broadcast(); c.mu.Unlock() })
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for !cond() {
		if c.readErr != nil {
			return fmt.Errorf("connection closed: %w", c.readErr)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %s", timeout)
		}
		c.cond.Wait()
	}
	return nil
}

// WaitClosed waits until the relay has closed the connection and returns the read error (a
// *websocket.CloseError carries the close code).
func (c *Client) WaitClosed(timeout time.Duration) error {
	c.t.Helper()
	var err error
	c.waitFor("close", timeout, func() bool { err = c.readErr; return err != nil })
	return err
}

// FirstVerb waits for the relay's first message and returns its verb (NIP-42 relays open with AUTH).
func (c *Client) FirstVerb() string {
	c.t.Helper()
	var v string
	c.waitFor("first message", 10*time.Second, func() bool { v = c.firstVerb; return v != "" })
	return v
}

// Challenge waits for the relay's AUTH challenge.
func (c *Client) Challenge() string {
	c.t.Helper()
	var ch string
	c.waitFor("AUTH challenge", 10*time.Second, func() bool { ch = c.challenge; return ch != "" })
	return ch
}

// okCount is how many OKs for id arrived so far.
func (c *Client) okCount(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.oks[id])
}

// waitOK waits for OK number n+1 for id (counting from 0) and returns it.
func (c *Client) waitOK(id string, n int, timeout time.Duration) OK {
	c.t.Helper()
	var r OK
	c.waitFor(fmt.Sprintf("OK #%d for %s", n+1, id), timeout, func() bool {
		if len(c.oks[id]) <= n {
			return false
		}
		r = c.oks[id][n]
		return true
	})
	return r
}

// WaitOK waits for the first OK for id (of an EVENT sent with SendEvent) and returns it.
func (c *Client) WaitOK(id string, timeout time.Duration) OK {
	c.t.Helper()
	return c.waitOK(id, 0, timeout)
}

// SendEvent sends an EVENT without waiting for its OK (pipelining).
func (c *Client) SendEvent(ev *nostr.Event) { c.t.Helper(); c.Send("EVENT", ev) }

// Publish sends an EVENT and returns the OK to this sending (an event sent before gets a new one).
func (c *Client) Publish(ev *nostr.Event) OK {
	c.t.Helper()
	n := c.okCount(ev.ID)
	c.SendEvent(ev)
	return c.waitOK(ev.ID, n, 20*time.Second)
}

// MustPublish is Publish that fails the test on a refusal; it returns the OK message.
func (c *Client) MustPublish(ev *nostr.Event) string {
	c.t.Helper()
	r := c.Publish(ev)
	if !r.OK {
		c.t.Fatalf("publish kind %d on %s refused: %s", ev.Kind, c.URL, r.Msg)
	}
	return r.Msg
}

// AuthWith answers the challenge as sk naming relayURL (Auth uses the dialled URL) and returns the
// relay's OK without judging it.
func (c *Client) AuthWith(sk, relayURL string) OK {
	c.t.Helper()
	ev, err := wsclient.AuthEvent(sk, relayURL, c.Challenge())
	if err != nil {
		c.t.Fatal(err)
	}
	n := c.okCount(ev.ID)
	c.Send("AUTH", ev)
	return c.waitOK(ev.ID, n, 10*time.Second)
}

// Auth authenticates the connection as each of the secret keys in turn (NIP-42 allows several).
func (c *Client) Auth(sks ...string) {
	c.t.Helper()
	for _, sk := range sks {
		if r := c.AuthWith(sk, c.URL); !r.OK {
			c.t.Fatalf("AUTH refused by %s: %s", c.URL, r.Msg)
		}
	}
}
