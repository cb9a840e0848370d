// Package bench is buzzpg's load and soak tooling: a raw NIP-01/42 WebSocket client that can
// pipeline and records what it sends and receives, latency statistics, the `buzzpg bench`
// scenarios with their same-run SQL baselines, and a helper that runs `buzzpg serve` processes.
// The chaos soak (tests/chaos) uses the client and the process helper too.
package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
)

// OK is a relay's answer to one EVENT.
type OK struct {
	ID  string
	OK  bool
	Msg string
	At  time.Time
}

// Handlers are called on the client's reader goroutine; keep them short.
type Handlers struct {
	OnEvent func(sub string, ev *nostr.Event, raw []byte, at time.Time)
	// OnRawEvent, when set, replaces OnEvent and skips decoding the event (a flooding client
	// that only counts what it gets keeps its CPU for sending).
	OnRawEvent func(sub string, raw []byte, at time.Time)
	OnOK       func(ok OK)
	OnEOSE     func(sub string, at time.Time)
	OnClosed   func(sub, msg string, at time.Time)
	OnNotice   func(msg string, at time.Time)
	OnEnd      func(err error, at time.Time) // the connection ended (read error)
}

// Client is a minimal NIP-01/42 client over gorilla/websocket. Writes are serialised; replies are
// dispatched by a single reader goroutine. It never reconnects: callers decide what a failure means.
type Client struct {
	URL  string
	conn *websocket.Conn
	wmu  sync.Mutex
	h    Handlers

	mu        sync.Mutex
	challenge string
	chalc     chan struct{} // closed when the challenge arrived
	waiters   map[string]chan OK
	eose      map[string]chan struct{}
	closed    map[string]string
	done      chan struct{}
	endErr    error
}

// Dial connects to url. The handlers may be zero.
func Dial(url string, h Handlers, timeout time.Duration) (*Client, error) {
	return DialFrom(url, "", h, timeout)
}

// DialFrom is Dial with the TCP connection bound to the local address localIP ("" = any). Linux
// routes all of 127.0.0.0/8 to lo, so a client bound to 127.0.0.2 is a second client IP to a relay
// on 127.0.0.1 (the flood scenario uses it to keep per-IP limits apart).
func DialFrom(url, localIP string, h Handlers, timeout time.Duration) (*Client, error) {
	d := websocket.Dialer{HandshakeTimeout: timeout, ReadBufferSize: 1 << 16, WriteBufferSize: 1 << 16}
	if localIP != "" {
		ip := net.ParseIP(localIP)
		if ip == nil {
			return nil, fmt.Errorf("bad local address %q", localIP)
		}
		nd := &net.Dialer{Timeout: timeout, LocalAddr: &net.TCPAddr{IP: ip}}
		d.NetDialContext = nd.DialContext
	}
	conn, _, err := d.Dial(url, nil)
	if err != nil {
		return nil, err
	}
	conn.SetReadLimit(1 << 24)
	c := &Client{URL: url, conn: conn, h: h, chalc: make(chan struct{}), waiters: map[string]chan OK{},
		eose: map[string]chan struct{}{}, closed: map[string]string{}, done: make(chan struct{})}
	go c.read()
	return c, nil
}

// Done is closed when the connection has ended.
func (c *Client) Done() <-chan struct{} { return c.done }

// Err is why the connection ended (after Done).
func (c *Client) Err() error { c.mu.Lock(); defer c.mu.Unlock(); return c.endErr }

// Close closes the connection.
func (c *Client) Close() { _ = c.conn.Close(); <-c.done }

func (c *Client) read() {
	defer close(c.done)
	for {
		_, data, err := c.conn.ReadMessage()
		now := time.Now()
		if err != nil {
			c.mu.Lock()
			c.endErr = err
			for id, w := range c.waiters {
				close(w)
				delete(c.waiters, id)
			}
			c.mu.Unlock()
			if c.h.OnEnd != nil {
				c.h.OnEnd(err, now)
			}
			return
		}
		c.dispatch(data, now)
	}
}

func (c *Client) dispatch(data []byte, now time.Time) {
	var msg []json.RawMessage
	if json.Unmarshal(data, &msg) != nil || len(msg) < 2 {
		return
	}
	var typ string
	_ = json.Unmarshal(msg[0], &typ)
	switch typ {
	case "EVENT":
		if len(msg) < 3 {
			return
		}
		var sub string
		_ = json.Unmarshal(msg[1], &sub)
		if c.h.OnRawEvent != nil {
			c.h.OnRawEvent(sub, msg[2], now)
			return
		}
		ev := &nostr.Event{}
		if json.Unmarshal(msg[2], ev) != nil {
			return
		}
		if c.h.OnEvent != nil {
			c.h.OnEvent(sub, ev, msg[2], now)
		}
	case "OK":
		if len(msg) < 4 {
			return
		}
		var o OK
		_ = json.Unmarshal(msg[1], &o.ID)
		_ = json.Unmarshal(msg[2], &o.OK)
		_ = json.Unmarshal(msg[3], &o.Msg)
		o.At = now
		if c.h.OnOK != nil {
			c.h.OnOK(o)
		}
		c.mu.Lock()
		w := c.waiters[o.ID]
		delete(c.waiters, o.ID)
		c.mu.Unlock()
		if w != nil {
			w <- o
		}
	case "EOSE":
		var sub string
		_ = json.Unmarshal(msg[1], &sub)
		if c.h.OnEOSE != nil {
			c.h.OnEOSE(sub, now)
		}
		c.mu.Lock()
		if w := c.eose[sub]; w != nil {
			close(w)
			delete(c.eose, sub)
		}
		c.mu.Unlock()
	case "CLOSED":
		var sub, m string
		_ = json.Unmarshal(msg[1], &sub)
		if len(msg) > 2 {
			_ = json.Unmarshal(msg[2], &m)
		}
		if c.h.OnClosed != nil {
			c.h.OnClosed(sub, m, now)
		}
		c.mu.Lock()
		c.closed[sub] = m
		if w := c.eose[sub]; w != nil {
			close(w)
			delete(c.eose, sub)
		}
		c.mu.Unlock()
	case "NOTICE":
		var m string
		_ = json.Unmarshal(msg[1], &m)
		if c.h.OnNotice != nil {
			c.h.OnNotice(m, now)
		}
	case "AUTH":
		var ch string
		_ = json.Unmarshal(msg[1], &ch)
		c.mu.Lock()
		if c.challenge == "" {
			c.challenge = ch
			close(c.chalc)
		}
		c.mu.Unlock()
	}
}

func (c *Client) write(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
	return c.conn.WriteMessage(websocket.TextMessage, b)
}

// ErrTimeout is returned when a reply did not come in time.
var ErrTimeout = errors.New("timeout waiting for the relay")

// ErrClosed is returned when the connection ended before the reply came.
var ErrClosed = errors.New("connection closed")

// Send writes an EVENT without waiting; its OK arrives through Handlers.OnOK.
func (c *Client) Send(ev *nostr.Event) error { return c.write([]any{"EVENT", ev}) }

// Publish writes an EVENT and waits for its OK.
func (c *Client) Publish(ev *nostr.Event, timeout time.Duration) (OK, error) {
	w := make(chan OK, 1)
	c.mu.Lock()
	if c.endErr != nil {
		c.mu.Unlock()
		return OK{}, ErrClosed
	}
	c.waiters[ev.ID] = w
	c.mu.Unlock()
	if err := c.write([]any{"EVENT", ev}); err != nil {
		c.mu.Lock()
		delete(c.waiters, ev.ID)
		c.mu.Unlock()
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
		c.mu.Lock()
		delete(c.waiters, ev.ID)
		c.mu.Unlock()
		return OK{}, ErrTimeout
	}
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

// Auth authenticates the connection as sk (NIP-42) and waits for the OK. before is called right
// before the AUTH frame is written (a soak client logs the moment it asked).
func (c *Client) Auth(sk string, timeout time.Duration, before func()) error {
	ch, err := c.Challenge(timeout)
	if err != nil {
		return err
	}
	ev, err := AuthEvent(sk, c.URL, ch)
	if err != nil {
		return err
	}
	w := make(chan OK, 1)
	c.mu.Lock()
	if c.endErr != nil {
		c.mu.Unlock()
		return ErrClosed
	}
	c.waiters[ev.ID] = w
	c.mu.Unlock()
	if before != nil {
		before()
	}
	if err := c.write([]any{"AUTH", ev}); err != nil {
		return err
	}
	select {
	case o, ok := <-w:
		if !ok {
			return ErrClosed
		}
		if !o.OK {
			return fmt.Errorf("auth refused: %s", o.Msg)
		}
		return nil
	case <-time.After(timeout):
		return ErrTimeout
	}
}

// Req opens a subscription and waits for EOSE (or CLOSED, returned as an error).
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
	if err := c.write(msg); err != nil {
		return err
	}
	select {
	case <-w:
		c.mu.Lock()
		m, closed := c.closed[sub]
		c.mu.Unlock()
		if closed {
			return fmt.Errorf("CLOSED %s: %s", sub, m)
		}
		return nil
	case <-c.done:
		return ErrClosed
	case <-time.After(timeout):
		return ErrTimeout
	}
}

// CloseSub ends a subscription (NIP-01 CLOSE); the relay sends nothing back.
func (c *Client) CloseSub(sub string) error { return c.write([]any{"CLOSE", sub}) }
