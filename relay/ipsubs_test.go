package relay

import "testing"

// TestSubscriptionsPerIP: one address's live subscriptions are bounded across its connections;
// a REQ over the bound is CLOSED restricted: and changes nothing, another address is not
// affected, a REQ replacing one of the same id takes no second place (at the bound too), and
// places come back when a subscription is CLOSEd or its connection ends. Each refusal is counted
// in buzz_subscriptions_refused_total{bound="ip"}.
func TestSubscriptionsPerIP(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxSubscriptionsPerIP = 3 })
	b := newSubBound(t, tr.s.ipSubs, "ip", "restricted: too many subscriptions from your address")
	a, _ := tr.dialFrom(t, "127.0.0.8", false)
	a2, _ := tr.dialFrom(t, "127.0.0.8", false)
	other, _ := tr.dialFrom(t, "127.0.0.9", false)

	b.steps(
		subStep{a, "a1", false},
		subStep{a, "a2", false},
		subStep{a, "a2", false}, // replaces a2: still two places
		subStep{a2, "b1", false},
		subStep{a2, "b2", true}, // the address's fourth
		subStep{a, "a3", true},
		subStep{a2, "b1", false}, // replaces b1 at the bound: its own place is given back first
		subStep{other, "o1", false},
		subStep{other, "o2", false},
		subStep{other, "o3", false},
	)
	if n := b.held("127.0.0.8"); n != 3 {
		t.Fatalf("127.0.0.8 holds %d places, want 3", n)
	}
	if n := b.refusals(); n != 2 {
		t.Fatalf("refusals counted %v, want 2", n)
	}

	a.sendJSON("CLOSE", "a1")
	b.waitHeld("127.0.0.8", 2) // the CLOSE is handled before a2 asks
	if got := b.open(a2, "b2"); got != "" {
		t.Fatalf("REQ after a CLOSE freed a place: CLOSED %q", got)
	}
	if got := b.open(a2, "b3"); got == "" {
		t.Fatal("REQ over the bound again was not CLOSED")
	}

	// a's connection ends: its remaining subscription (a2) gives its place back.
	a.ws.Close()
	b.waitHeld("127.0.0.8", 2)
	if got := b.open(a2, "b3"); got != "" {
		t.Fatalf("REQ after a's connection ended: CLOSED %q", got)
	}
	if n := b.held("127.0.0.8"); n != 3 {
		t.Fatalf("127.0.0.8 holds %d places, want 3 (b1, b2, b3)", n)
	}
	a2.ws.Close()
	other.ws.Close()
	b.waitHeld("127.0.0.8", 0)
	b.waitHeld("127.0.0.9", 0)
}
