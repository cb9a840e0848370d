package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// TestSubscriptionsPerIP: one address's live subscriptions are bounded across its connections;
// a REQ over the bound is CLOSED restricted: and changes nothing, another address is not
// affected, a REQ replacing one of the same id takes no second place (at the bound too), and
// places come back when a subscription is CLOSEd or its connection ends. Each refusal is counted
// in buzz_subscriptions_refused_total{bound="ip"}.
func TestSubscriptionsPerIP(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxSubscriptionsPerIP = 3 })
	f := nostr.Filter{Kinds: []int{1}, Limit: 1}
	open := func(c *client, id string) string {
		t.Helper()
		_, closed := c.reqOrClosed(id, f)
		return closed
	}
	held := func(ip string) int {
		tr.s.ipSubs.mu.Lock()
		defer tr.s.ipSubs.mu.Unlock()
		return tr.s.ipSubs.held[ip]
	}
	waitHeld := func(ip string, n int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for held(ip) != n {
			if time.Now().After(deadline) {
				t.Fatalf("%s holds %d places, want %d", ip, held(ip), n)
			}
			time.Sleep(time.Millisecond)
		}
	}
	refusedBefore := testutil.ToFloat64(metrics.SubscriptionsRefused.WithLabelValues("ip"))
	a, _ := tr.dialFrom(t, "127.0.0.8", false)
	b, _ := tr.dialFrom(t, "127.0.0.8", false)
	other, _ := tr.dialFrom(t, "127.0.0.9", false)

	for _, step := range []struct {
		c      *client
		id     string
		closed bool
	}{
		{a, "a1", false},
		{a, "a2", false},
		{a, "a2", false}, // replaces a2: still two places
		{b, "b1", false},
		{b, "b2", true}, // the address's fourth
		{a, "a3", true},
		{b, "b1", false}, // replaces b1 at the bound: its own place is given back first
		{other, "o1", false},
		{other, "o2", false},
		{other, "o3", false},
	} {
		got := open(step.c, step.id)
		if step.closed != (got != "") || (got != "" && !strings.HasPrefix(got, "restricted: too many subscriptions from your address")) {
			t.Fatalf("REQ %s: CLOSED %q, want closed %v", step.id, got, step.closed)
		}
	}
	if n := held("127.0.0.8"); n != 3 {
		t.Fatalf("127.0.0.8 holds %d places, want 3", n)
	}
	if n := testutil.ToFloat64(metrics.SubscriptionsRefused.WithLabelValues("ip")) - refusedBefore; n != 2 {
		t.Fatalf("refusals counted %v, want 2", n)
	}

	a.sendJSON("CLOSE", "a1")
	waitHeld("127.0.0.8", 2) // the CLOSE is handled before b asks
	if got := open(b, "b2"); got != "" {
		t.Fatalf("REQ after a CLOSE freed a place: CLOSED %q", got)
	}
	if got := open(b, "b3"); got == "" {
		t.Fatal("REQ over the bound again was not CLOSED")
	}

	// a's connection ends: its remaining subscription (a2) gives its place back.
	a.ws.Close()
	waitHeld("127.0.0.8", 2)
	if got := open(b, "b3"); got != "" {
		t.Fatalf("REQ after a's connection ended: CLOSED %q", got)
	}
	if n := held("127.0.0.8"); n != 3 {
		t.Fatalf("127.0.0.8 holds %d places, want 3 (b1, b2, b3)", n)
	}
	b.ws.Close()
	other.ws.Close()
	waitHeld("127.0.0.8", 0)
	waitHeld("127.0.0.9", 0)
}
