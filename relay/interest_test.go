package relay

import (
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Every filter shape that can match a DM event must keep it deliverable while its DM's members
// are not cached: the interest index may only answer "no" when no live filter could match. Each
// shape gets a DM of its own, so every delivery below runs the uncached pre-check.
func TestDeliveryReachesEveryFilterShapeOfAnUncachedDM(t *testing.T) {
	tr := startRelay(t, nil)
	a := newParty(t, tr, true)
	for _, tc := range []struct {
		name   string
		filter func(ch, id string) nostr.Filter
	}{
		{"kinds", func(_, _ string) nostr.Filter { return nostr.Filter{Kinds: []int{9}} }},
		{"authors only (no kinds)", func(_, _ string) nostr.Filter { return nostr.Filter{Authors: []string{a.pk}} }},
		{"#h only", func(ch, _ string) nostr.Filter { return nostr.Filter{Tags: nostr.TagMap{"h": []string{ch}}} }},
		{"kinds and #h", func(ch, _ string) nostr.Filter {
			return nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": []string{ch}}}
		}},
		{"#h among others", func(ch, _ string) nostr.Filter {
			return nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": []string{randUUID(), ch, randUUID()}}}
		}},
		{"kinds among others", func(_, _ string) nostr.Filter { return nostr.Filter{Kinds: []int{1, 7, 9, 30622}} }},
		{"ids", func(_, id string) nostr.Filter { return nostr.Filter{IDs: []string{id}} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The previous shape's connection must be gone, or its filter would answer for this one.
			testenv.WaitUntil(t, 10*time.Second, "the previous subscriptions to end", tr.s.interest.empty)
			b := newParty(t, tr, true)
			ch := openDM(t, a, b.pk)
			m := signed(a.sk, 9, "to "+tc.name, nostr.Now(), nostr.Tag{"h", ch})
			if tr.s.interest.mayMatch(&m) {
				t.Fatal("interest in a DM before anyone subscribed")
			}
			b.c.req("live", nostr.Filter{Kinds: []int{7}}, tc.filter(ch, m.ID)) // beside one that cannot match
			// An #h filter's REQ gate looked the members up; as after an announced member edit,
			// the cache forgets them.
			tr.s.members.forget(evt.MembersChange{Channels: []string{ch}}, 0)
			if _, cached := tr.s.members.get(ch); cached {
				t.Fatal("the DM's members are cached: the test would not run the pre-check")
			}
			deliverExpect(tr, b.c, m, evt.Scope{Kind: evt.ScopeChannel, Channel: ch})
		})
	}
}

// The index counts a subscription from its registration until it ends, whichever way it ends:
// CLOSE, a REQ reusing its id, CLOSED from the relay (closeID: a malformed REQ naming it), the
// connection closing. A leak would not lose events, but would bring back the walk it exists to avoid.
func TestInterestFollowsSubscriptionsUntilTheyEnd(t *testing.T) {
	tr := startRelay(t, nil)
	in := tr.s.interest
	a := newParty(t, tr, true)
	ch, other := openDM(t, a, newParty(t, tr, false).pk), openDM(t, a, newParty(t, tr, false).pk)
	dm := signed(a.sk, 9, "", nostr.Now(), nostr.Tag{"h", ch})
	reaction := signed(a.sk, 7, "", nostr.Now())
	if !in.empty() {
		t.Fatal("a relay without subscriptions counts some")
	}

	a.c.req("h", nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": []string{other}}})
	if in.mayMatch(&dm) {
		t.Fatal("a filter for another DM counts as interest in this one")
	}
	a.c.req("h", nostr.Filter{Tags: nostr.TagMap{"h": []string{ch}}}) // replaces the one for other
	if !in.mayMatch(&dm) {
		t.Fatal("a filter for this DM is not counted")
	}
	a.c.sendJSON("CLOSE", "h")
	handled(a.c)
	if in.mayMatch(&dm) {
		t.Fatal("a CLOSEd subscription still counts")
	}

	a.c.req("r", nostr.Filter{Kinds: []int{7}})
	if in.mayMatch(&dm) || !in.mayMatch(&reaction) {
		t.Fatal("kind 7 interest counted wrong")
	}
	a.c.sendJSON("REQ", "r", "not a filter") // CLOSED invalid: ends the subscription of that id
	if _, reason := a.c.collect("r"); reason == "" {
		t.Fatal("a malformed REQ was not answered CLOSED")
	}
	handled(a.c)
	if in.mayMatch(&reaction) {
		t.Fatal("a subscription the relay CLOSED still counts")
	}

	b := newParty(t, tr, false)
	b.c.req("by", nostr.Filter{Authors: []string{a.pk}})
	if !in.mayMatch(&dm) {
		t.Fatal("a filter for the DM event's author is not counted")
	}
	b.c.req("any", nostr.Filter{Limit: 1})
	if !in.mayMatch(&reaction) {
		t.Fatal("a filter with no conditions is not counted as interest in every event")
	}
	b.c.ws.Close()
	testenv.WaitUntil(t, 10*time.Second, "the closed connection's subscription to be uncounted", in.empty)
	a.c.ws.Close()
	testenv.WaitUntil(t, 10*time.Second, "every subscription uncounted", in.empty)
}

func randUUID() string {
	h := randHex64()
	return h[0:8] + "-" + h[8:12] + "-4" + h[13:16] + "-8" + h[17:20] + "-" + h[20:32]
}

// A public event goes only to the connections the index names: every filter shape that can match
// it must name the connection, and one whose filters cannot must not get it.
func TestPublicDeliveryReachesEveryFilterShape(t *testing.T) {
	tr := startRelay(t, nil)
	a := newParty(t, tr, false)
	for _, tc := range []struct {
		name   string
		filter func(id string) nostr.Filter
	}{
		{"kinds", func(string) nostr.Filter { return nostr.Filter{Kinds: []int{1}} }},
		{"kinds among others", func(string) nostr.Filter { return nostr.Filter{Kinds: []int{0, 1, 7, 30023}} }},
		{"authors only (no kinds)", func(string) nostr.Filter { return nostr.Filter{Authors: []string{a.pk}} }},
		{"a tag only", func(string) nostr.Filter { return nostr.Filter{Tags: nostr.TagMap{"t": []string{"topic"}}} }},
		{"ids", func(id string) nostr.Filter { return nostr.Filter{IDs: []string{id}} }},
		{"ids among others, with kinds", func(id string) nostr.Filter {
			return nostr.Filter{IDs: []string{randHex64(), id}, Kinds: []int{1}}
		}},
		{"authors among others, with kinds", func(string) nostr.Filter {
			return nostr.Filter{Authors: []string{randHex64(), a.pk, randHex64()}, Kinds: []int{1}}
		}},
		{"since only", func(string) nostr.Filter { ts := nostr.Timestamp(1); return nostr.Filter{Since: &ts} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, other := newParty(t, tr, false), newParty(t, tr, true)
			ch := openDM(t, other, newParty(t, tr, false).pk)
			other.c.req("other", nostr.Filter{Kinds: []int{7}}, nostr.Filter{Kinds: []int{1, 9}, Tags: nostr.TagMap{"h": []string{ch}}},
				nostr.Filter{Authors: []string{other.pk}}, nostr.Filter{IDs: []string{randHex64()}, Kinds: []int{1}})
			m := signed(a.sk, 1, "to "+tc.name, nostr.Now(), nostr.Tag{"t", "topic"})
			b.c.req("live", nostr.Filter{Kinds: []int{7}}, tc.filter(m.ID)) // beside one that cannot match
			for _, c := range tr.s.interest.candidates(&m) {
				c.mu.Lock()
				_, isOther := c.subs["other"]
				c.mu.Unlock()
				if isOther {
					t.Fatal("a connection whose filters cannot match is a candidate")
				}
			}
			deliverExpect(tr, b.c, m, evt.Scope{Kind: evt.ScopePublic})
		})
	}
}

// Counts, not sets: a connection with two filters that share a kind or an h value, in one
// subscription or in two, stays listed until the last of them ends.
func TestInterestCountsEachFilterOfAConnection(t *testing.T) {
	tr := startRelay(t, nil)
	in := tr.s.interest
	a := newParty(t, tr, true)
	ch := openDM(t, a, newParty(t, tr, false).pk)
	dm := signed(a.sk, 9, "", nostr.Now(), nostr.Tag{"h", ch})
	note := signed(a.sk, 1, "", nostr.Now())
	listed := func() bool { return len(in.candidates(&note)) == 1 }

	a.c.req("one", nostr.Filter{Kinds: []int{1}}, nostr.Filter{Kinds: []int{1, 7}})
	a.c.req("two", nostr.Filter{Kinds: []int{1}})
	a.c.req("h1", nostr.Filter{Tags: nostr.TagMap{"h": []string{ch}}})
	a.c.req("h2", nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": []string{ch}}}, nostr.Filter{Tags: nostr.TagMap{"h": []string{ch}}})
	if !listed() || !in.mayMatch(&dm) {
		t.Fatal("the subscriptions are not counted")
	}
	for _, id := range []string{"one", "h1"} {
		a.c.sendJSON("CLOSE", id)
	}
	handled(a.c)
	if !listed() {
		t.Fatal("closing one of two subscriptions for kind 1 took the connection out")
	}
	if !in.mayMatch(&dm) {
		t.Fatal("closing one of two subscriptions for the DM took its interest out")
	}
	a.c.sendJSON("CLOSE", "two")
	a.c.sendJSON("CLOSE", "h2")
	handled(a.c)
	if len(in.candidates(&note)) != 0 || in.mayMatch(&dm) {
		t.Fatal("the connection is still counted after its last subscription ended")
	}
	testenv.WaitUntil(t, 10*time.Second, "no counts left once the last REQ of handled is closed", in.empty)
}

// deliverExpect hands m to live delivery and waits for it on c's subscription "live".
func deliverExpect(tr *testRelay, c *client, m nostr.Event, scope evt.Scope) {
	c.t.Helper()
	tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: scope})
	if got := c.nextEvent("live"); got.ID != m.ID {
		c.t.Fatalf("live event %s, want %s", got.ID, m.ID)
	}
}

// handled returns once the relay has handled everything c sent before: a connection's messages
// are handled in order, so a later REQ's EOSE says so. Its subscription (kind 5, which no event
// in these tests has) is closed again; that CLOSE is handled with the next message.
func handled(c *client) {
	c.t.Helper()
	c.req("handled", nostr.Filter{Kinds: []int{5}, Limit: 1})
	c.sendJSON("CLOSE", "handled")
}
