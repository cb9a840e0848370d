package relay

import (
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// I6: no connection receives a due signal twice, however many of its subscriptions match the
// reminder. It goes to a reminders subscription (kind 30300 alone) if there is one, the lowest
// id among equals; a broader subscription gets it only when no reminders subscription matches.
func TestDueSignalOncePerConnectionAcrossSubscriptions(t *testing.T) {
	tr := startRelay(t, nil)
	a := newParty(t, tr, true)
	rem := signed(a.sk, 30300, "enc", nostr.Now(), nostr.Tag{"d", "r-" + nonce()})
	a.c.mustPublish(rem)
	// Initial answers empty (since an hour ahead); due signals ignore since.
	ahead := nostr.Filter{Kinds: []int{30300}, Since: ts(int64(nostr.Now()) + 3600)}
	broad := nostr.Filter{Kinds: []int{1, 30300}, Since: ahead.Since}
	for sub, f := range map[string]nostr.Filter{"z-due": ahead, "a-all": broad, "m-due": ahead} {
		if got := a.c.req(sub, f); len(got) != 0 {
			t.Fatalf("%s: initial answer has %d reminders", sub, len(got))
		}
	}
	// Another connection of the same author gets its own copy.
	other := tr.dial(t)
	other.mustAuth(a.sk, tr.url)
	if got := other.req("x-due", broad); len(got) != 0 {
		t.Fatalf("second connection: initial answer has %d reminders", len(got))
	}

	tr.s.DeliverDue(evt.Due{Event: &rem, Stamp: 7})

	// Everything Deliver enqueued precedes a fresh REQ's EOSE.
	received := func(c *client) map[string]int {
		got := map[string]int{}
		probe := "probe-" + nonce()
		c.sendJSON("REQ", probe, nostr.Filter{IDs: []string{randHex64()}})
		for {
			m := c.read()
			if c.verb(m) == "EVENT" {
				got[str(m[1])]++
			}
			if c.verb(m) == "EOSE" && str(m[1]) == probe {
				c.sendJSON("CLOSE", probe)
				return got
			}
		}
	}
	if got := received(a.c); len(got) != 1 || got["m-due"] != 1 {
		t.Fatalf("due signal per subscription %v, want once, on m-due only", got)
	}
	if got := received(other); len(got) != 1 || got["x-due"] != 1 {
		t.Fatalf("second connection (a broad subscription only) got %v, want once on x-due", got)
	}
}
