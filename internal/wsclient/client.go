// Package wsclient is the one NIP-01/42 WebSocket client of buzzpg's tests and load tool: it
// pipelines, hands every frame the relay sends to handlers on one reader goroutine, and waits for
// an OK, an EOSE or the AUTH challenge. It never reconnects: callers decide what a failure means.
// internal/testenv records what arrives on top of it; internal/bench and the chaos soak use it as is.
package wsclient

import (
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
)

// OK is a relay's answer to one EVENT or AUTH.
type OK struct {
	ID  string
	OK  bool
	Msg string
	At  time.Time
}

// Handlers are called on the client's reader goroutine, in the order frames arrive; keep them short.
type Handlers struct {
	OnEvent func(sub string, ev *nostr.Event, at time.Time)
	// OnRawEvent, when set, replaces OnEvent and skips decoding the event (a flooding client
	// that only counts what it gets keeps its CPU for sending).
	OnRawEvent func(sub string, raw []byte, at time.Time)
	OnOK       func(ok OK)
	OnEOSE     func(sub string, at time.Time)
	OnClosed   func(sub, msg string, at time.Time)
	OnNotice   func(msg string, at time.Time)
	OnAuth     func(challenge string, at time.Time)
	OnEnd      func(err error, at time.Time) // the connection ended (read error)
}

// Client is one connection. Writes are serialised; replies are dispatched by a single reader.
type Client struct {
	URL  string
	conn *websocket.Conn
	wmu  sync.Mutex
	h    Handlers

	mu        sync.Mutex
	challenge string
	chalc     chan struct{} // closed when the first challenge arrived
	waiters   map[string]chan OK
	eose      map[string]chan struct{}
	closed    map[string]string
	done      chan struct{}
	ended     bool
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

// Done is closed when the connection has ended (after Handlers.OnEnd returned).
func (c *Client) Done() <-chan struct{} { return c.done }

// Close closes the connection and waits for the reader to stop.
func (c *Client) Close() { _ = c.conn.Close(); <-c.done }

func (c *Client) read() {
	defer close(c.done)
	for {
		_, data, err := c.conn.ReadMessage()
		now := time.Now()
		if err != nil {
			c.mu.Lock()
			c.ended = true
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
