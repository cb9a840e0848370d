package wsclient

import (
	"bytes"
	"encoding/json"
	"time"

	"github.com/nbd-wtf/go-nostr"
)

// dispatch decodes one frame and hands it to its handler (and to whoever waits for it).
func (c *Client) dispatch(data []byte, now time.Time) {
	if c.h.OnRawEvent == nil && bytes.HasPrefix(data, []byte(`["EVENT",`)) {
		c.event(data, now)
		return
	}
	var msg []json.RawMessage
	if json.Unmarshal(data, &msg) != nil || len(msg) < 2 {
		return
	}
	var verb, arg string
	_ = json.Unmarshal(msg[0], &verb)
	_ = json.Unmarshal(msg[1], &arg) // subscription id, event id, challenge or notice
	switch verb {
	case "EVENT":
		if len(msg) >= 3 && c.h.OnRawEvent != nil {
			c.h.OnRawEvent(arg, msg[2], now)
		}
	case "OK":
		if len(msg) >= 4 {
			o := OK{ID: arg, At: now}
			_ = json.Unmarshal(msg[2], &o.OK)
			_ = json.Unmarshal(msg[3], &o.Msg)
			c.ok(o)
		}
	case "EOSE":
		if c.h.OnEOSE != nil {
			c.h.OnEOSE(arg, now)
		}
		c.endReq(arg, nil)
	case "CLOSED":
		var m string
		if len(msg) > 2 {
			_ = json.Unmarshal(msg[2], &m)
		}
		if c.h.OnClosed != nil {
			c.h.OnClosed(arg, m, now)
		}
		c.endReq(arg, &m)
	case "NOTICE":
		if c.h.OnNotice != nil {
			c.h.OnNotice(arg, now)
		}
	case "AUTH":
		c.auth(arg, now)
	}
}

// event decodes an EVENT, the bulk of what a subscriber reads, in one pass with go-nostr's
// envelope decoder instead of a generic array decode followed by the event's own.
func (c *Client) event(data []byte, now time.Time) {
	var env nostr.EventEnvelope
	if env.UnmarshalJSON(data) != nil || env.SubscriptionID == nil {
		return
	}
	if c.h.OnEvent != nil {
		c.h.OnEvent(*env.SubscriptionID, &env.Event, now)
	}
}

// ok hands an OK to its handler, then to the Publish or Auth waiting for it.
func (c *Client) ok(o OK) {
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
}

// endReq ends the wait of the Req for sub, at its EOSE or (closed != nil) its CLOSED.
func (c *Client) endReq(sub string, closed *string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if closed != nil {
		c.closed[sub] = *closed
	}
	if w := c.eose[sub]; w != nil {
		close(w)
		delete(c.eose, sub)
	}
}

// auth records the relay's challenge (the latest one; Challenge returns once the first came).
func (c *Client) auth(challenge string, now time.Time) {
	c.mu.Lock()
	c.challenge = challenge
	select {
	case <-c.chalc:
	default:
		close(c.chalc)
	}
	c.mu.Unlock()
	if c.h.OnAuth != nil {
		c.h.OnAuth(challenge, now)
	}
}
