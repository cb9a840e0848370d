package relay

import (
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"
)

// A gift wrap is served to the pubkey in its p tag (docs/protocol.md), and the SQL gate reads it as
// the first p. A wrap naming a second recipient would be readable by the first only, while the
// closing rule, which judges a filter by its #p values, would close a filter that matches it for
// its reader: {"kinds":[1059],"#p":[X]} from Y answers CLOSED restricted although Y may read a
// wrap [p Y][p X]. The relay refuses such wraps (NIP-59: one wrap per recipient), so the closing
// rule and the gate agree on everything stored: the #p filter of someone else's key is closed,
// and no wrap its sender could read is behind it.
func TestGiftWrapNamesOneRecipient(t *testing.T) {
	tr := startRelay(t, nil)
	y := newParty(t, tr, true)
	x := newParty(t, tr, true)

	two := signed(y.sk, 1059, "sealed", nostr.Now(), nostr.Tag{"p", y.pk}, nostr.Tag{"p", x.pk})
	if r := y.c.publish(two); r.ok || !strings.HasPrefix(r.msg, "invalid:") {
		t.Fatalf("a wrap to two recipients: %+v, want invalid:", r)
	}
	if n := tr.eventCount(t, "id = $1", two.ID); n != 0 {
		t.Fatal("the refused wrap was stored")
	}
	// Y may read nothing a filter on X's p tag matches: closed, as the gate would answer nothing.
	if _, closed := y.c.reqOrClosed("x", nostr.Filter{Kinds: []int{1059}, Tags: nostr.TagMap{"p": {x.pk}}}); !strings.HasPrefix(closed, "restricted:") {
		t.Fatalf("Y's filter on X's p: CLOSED %q, want restricted:", closed)
	}
	// The same recipient twice (with a relay hint, say) is still one recipient.
	one := signed(x.sk, 1059, "sealed", nostr.Now(), nostr.Tag{"p", y.pk}, nostr.Tag{"p", y.pk, "wss://relay.example"})
	y.c.mustPublish(one)
	sameIDs(t, "recipient", y.c.req("y", nostr.Filter{Kinds: []int{1059}, Tags: nostr.TagMap{"p": {y.pk}}}), one)
}

// A gift wrap with an h tag is refused before accept_event runs (sql/0002_accept.up.sql refuses it too): the
// channel's members and the recipient would both have a claim to read it. The connection stays.
func TestGiftWrapNamesNoChannel(t *testing.T) {
	tr := startRelay(t, nil)
	y := newParty(t, tr, true)
	x := newParty(t, tr, true)
	for _, h := range []string{"6a0f5f4e-2f3c-4b7a-9d1e-0c4f3b2a1e9d", "not-a-channel"} {
		wrap := signed(y.sk, 1059, "sealed", nostr.Now(), nostr.Tag{"p", x.pk}, nostr.Tag{"h", h})
		if r := y.c.publish(wrap); r.ok || !strings.HasPrefix(r.msg, "invalid: a gift wrap names no channel") {
			t.Fatalf("a wrap naming channel %q: %+v, want invalid:", h, r)
		}
		if n := tr.eventCount(t, "id = $1", wrap.ID); n != 0 {
			t.Fatal("the refused wrap was stored")
		}
	}
	y.c.mustPublish(signed(y.sk, 1059, "sealed", nostr.Now(), nostr.Tag{"p", x.pk}))
}
