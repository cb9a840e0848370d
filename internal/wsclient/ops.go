package wsclient

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
)

// ErrTimeout is returned when a reply did not come in time.
var ErrTimeout = errors.New("timeout waiting for the relay")

// ErrClosed is returned when the connection ended before the reply came.
var ErrClosed = errors.New("connection closed")

// ClosedError is a Req the relay answered with CLOSED.
type ClosedError struct{ Sub, Reason string }

func (e *ClosedError) Error() string { return fmt.Sprintf("CLOSED %s: %s", e.Sub, e.Reason) }

// Write sends one message, e.g. Write("REQ", id, filter).
func (c *Client) Write(msg ...any) error {
	b, err := json.Marshal(msg)
	if err != nil {
		return err
	}
	return c.WriteRaw(b)
}

// WriteRaw sends a text frame as given (for malformed or oversized input). A frame the relay
// refuses while it is still being written (an oversized one is closed with 1009 from its header)
// ends the write with the close instead of completing it: the error says so.
func (c *Client) WriteRaw(b []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	return c.conn.WriteMessage(websocket.TextMessage, b)
}

// Send writes an EVENT without waiting; its OK arrives through Handlers.OnOK.
func (c *Client) Send(ev *nostr.Event) error { return c.Write("EVENT", ev) }

// Publish writes an EVENT and waits for its OK.
func (c *Client) Publish(ev *nostr.Event, timeout time.Duration) (OK, error) {
	return c.call(ev.ID, timeout, nil, "EVENT", ev)
}

// call registers a waiter for the OK of id, calls before, writes msg and waits for the OK.
func (c *Client) call(id string, timeout time.Duration, before func(), msg ...any) (OK, error) {
	w := make(chan OK, 1)
	c.mu.Lock()
	if c.ended {
		c.mu.Unlock()
		return OK{}, ErrClosed
	}
	c.waiters[id] = w
	c.mu.Unlock()
	if before != nil {
		before()
	}
	if err := c.Write(msg...); err != nil {
		c.forget(id)
		return OK{}, err
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case o, ok := <-w:
		if !ok {
			return OK{}, ErrClosed
		}
		return o, nil
	case <-t.C:
		c.forget(id)
		return OK{}, ErrTimeout
	}
}

func (c *Client) forget(id string) {
	c.mu.Lock()
	delete(c.waiters, id)
	c.mu.Unlock()
}

// Challenge waits for the relay's NIP-42 challenge.
func (c *Client) Challenge(timeout time.Duration) (string, error) {
	select {
	case <-c.chalc:
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.challenge, nil
	case <-c.done:
		return "", ErrClosed
	case <-time.After(timeout):
		return "", ErrTimeout
	}
}

// AuthEvent builds the signed kind 22242 answering challenge for relayURL.
func AuthEvent(sk, relayURL, challenge string) (*nostr.Event, error) {
	ev := &nostr.Event{Kind: 22242, CreatedAt: nostr.Now(),
		Tags: nostr.Tags{{"relay", relayURL}, {"challenge", challenge}}}
	return ev, ev.Sign(sk)
}

// Auth authenticates the connection as sk (NIP-42) and waits for the OK; a refusal is an error.
// before is called right before the AUTH frame is written (a soak client logs the moment it asked).
func (c *Client) Auth(sk string, timeout time.Duration, before func()) error {
	o, err := c.AuthAs(sk, c.URL, timeout, before)
	if err == nil && !o.OK {
		err = fmt.Errorf("auth refused: %s", o.Msg)
	}
	return err
}

// AuthAs answers the challenge as sk naming relayURL and returns the relay's OK without judging it.
func (c *Client) AuthAs(sk, relayURL string, timeout time.Duration, before func()) (OK, error) {
	ch, err := c.Challenge(timeout)
	if err != nil {
		return OK{}, err
	}
	ev, err := AuthEvent(sk, relayURL, ch)
	if err != nil {
		return OK{}, err
	}
	return c.call(ev.ID, timeout, before, "AUTH", ev)
}

// Req opens a subscription and waits for EOSE (or CLOSED, returned as a *ClosedError).
func (c *Client) Req(sub string, timeout time.Duration, filters ...nostr.Filter) error {
	w := make(chan struct{})
	c.mu.Lock()
	c.eose[sub] = w
	delete(c.closed, sub)
	c.mu.Unlock()
	msg := []any{"REQ", sub}
	for _, f := range filters {
		msg = append(msg, f)
	}
	if err := c.Write(msg...); err != nil {
		return err
	}
	select {
	case <-w:
		c.mu.Lock()
		m, closed := c.closed[sub]
		c.mu.Unlock()
		if closed {
			return &ClosedError{sub, m}
		}
		return nil
	case <-c.done:
		return ErrClosed
	case <-time.After(timeout):
		return ErrTimeout
	}
}

// CloseSub ends a subscription (NIP-01 CLOSE); the relay sends nothing back.
func (c *Client) CloseSub(sub string) error { return c.Write("CLOSE", sub) }
