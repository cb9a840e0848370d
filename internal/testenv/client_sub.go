package testenv

import (
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/nbd-wtf/go-nostr"
)

// Sub is one subscription of a Client: what arrived on it, in order, with a count per event id.
type Sub struct {
	ID     string
	c      *Client
	events []*nostr.Event
	count  map[string]int
	first  map[string]time.Time // arrival of each id's first copy
	eose   bool
	closed bool
	reason string // of the CLOSED
}

// add records an EVENT (c.mu held).
func (s *Sub) add(ev *nostr.Event, at time.Time) {
	s.events = append(s.events, ev)
	if s.count[ev.ID] == 0 {
		s.first[ev.ID] = at
	}
	s.count[ev.ID]++
}

var subSeq atomic.Int64

// Req opens a subscription and waits for its EOSE or CLOSED; stored events are on it by then and
// live ones follow.
func (c *Client) Req(filters ...nostr.Filter) *Sub {
	c.t.Helper()
	s := &Sub{ID: fmt.Sprintf("s%d", subSeq.Add(1)), c: c, count: map[string]int{}, first: map[string]time.Time{}}
	c.mu.Lock()
	c.subs[s.ID] = s // before the REQ goes out, so no EVENT of it is missed
	c.mu.Unlock()
	msg := []any{"REQ", s.ID}
	for _, f := range filters {
		msg = append(msg, f)
	}
	c.Send(msg...)
	c.waitFor("EOSE of "+s.ID, 20*time.Second, func() bool { return s.eose || s.closed })
	return s
}

// Subscribe is Req that fails the test when the relay refuses the subscription.
func (c *Client) Subscribe(filters ...nostr.Filter) *Sub {
	c.t.Helper()
	s := c.Req(filters...)
	if closed, reason := s.Closed(); closed {
		c.t.Fatalf("subscription %s on %s closed: %s", s.ID, c.URL, reason)
	}
	return s
}

// Closed reports whether the relay sent CLOSED for the subscription, and its reason.
func (s *Sub) Closed() (bool, string) {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.closed, s.reason
}

// Events returns what arrived so far, in order.
func (s *Sub) Events() []*nostr.Event {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return slices.Clone(s.events)
}

// Counts returns how often each id arrived.
func (s *Sub) Counts() map[string]int {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return maps.Clone(s.count)
}

// FirstAt returns when the first copy of id arrived (zero if none did).
func (s *Sub) FirstAt(id string) time.Time {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.first[id]
}

// WaitEvents waits until every id has arrived at least once.
func (s *Sub) WaitEvents(timeout time.Duration, ids ...string) {
	s.c.t.Helper()
	// An id that arrived stays arrived, so the scan resumes where it stopped: checking all ids
	// on every arriving event would be quadratic and, holding the client's lock, would slow the
	// reader whose receive times benchmarks measure.
	next := 0
	s.c.waitFor(fmt.Sprintf("%d events on %s", len(ids), s.ID), timeout, func() bool {
		for ; next < len(ids); next++ {
			if s.count[ids[next]] == 0 {
				return false
			}
		}
		return true
	})
}

// WaitN waits until at least n EVENTs arrived and returns all of them.
func (s *Sub) WaitN(n int, timeout time.Duration) []*nostr.Event {
	s.c.t.Helper()
	var out []*nostr.Event
	s.c.waitFor(fmt.Sprintf("%d events on %s", n, s.ID), timeout, func() bool {
		if len(s.events) < n {
			return false
		}
		out = slices.Clone(s.events)
		return true
	})
	return out
}
