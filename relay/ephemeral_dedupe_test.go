package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// accept_event stores no ephemeral event, so it cannot say "duplicate:"; the process remembers
// the ones it accepted and answers a resend itself, without fanning it out again.
func TestEphemeralSentAgainIsADuplicate(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, _ := testenv.NewKey()
	ev := signed(sk, 20001, "typing", nostr.Now())
	if r := c.publish(ev); !r.ok || r.msg != "" {
		t.Fatalf("first send: %+v, want accepted", r)
	}
	if r := c.publish(ev); !r.ok || !strings.HasPrefix(r.msg, "duplicate:") {
		t.Fatalf("second send: %+v, want OK true duplicate:", r)
	}
	// Another ephemeral event is not affected.
	if r := c.publish(signed(sk, 20001, "typing again", nostr.Now())); !r.ok || r.msg != "" {
		t.Fatalf("another ephemeral event: %+v, want accepted", r)
	}
}

func TestRecentEphemeralBounds(t *testing.T) {
	var r recentEphemeral
	now := time.Now()
	r.add(fifoKey(0), now)
	if !r.seen(fifoKey(0), now.Add(ephemeralDedupeTTL-time.Second)) || r.seen(fifoKey(0), now.Add(ephemeralDedupeTTL)) {
		t.Fatal("an id is remembered for the TTL and no longer")
	}
	for i := 1; i <= ephemeralDedupeMax; i++ {
		r.add(fifoKey(i), now)
	}
	if r.seen(fifoKey(0), now) || !r.seen(fifoKey(1), now) || len(r.at) != ephemeralDedupeMax {
		t.Fatalf("past the count bound the oldest goes: %d kept", len(r.at))
	}
}
