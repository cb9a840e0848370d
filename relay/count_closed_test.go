package relay

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A refused or failed COUNT is answered CLOSED (NIP-45), and a client cannot tell that CLOSED from
// one for a REQ of the same id: the relay ends that REQ too, so it delivers nothing more to a
// subscription the client holds closed.
func TestRefusedCountEndsTheREQOfItsID(t *testing.T) {
	sk, pk := testenv.NewKey()
	live := func(t *testing.T, tr *testRelay, c *client, count []byte, wantPrefix string, then ...func()) {
		t.Helper()
		c.req("s", nostr.Filter{Authors: []string{pk}})
		for _, f := range then {
			f()
		}
		c.sendRaw(count)
		m := c.expect("CLOSED")
		if str(m[1]) != "s" || !strings.HasPrefix(str(m[2]), wantPrefix) {
			t.Fatalf("COUNT answered %s, want CLOSED s %q...", joinRaw(m), wantPrefix)
		}
		ev := signed(sk, 1, "after the CLOSED "+nonce(), nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
		barrierNone(t, c, "s")
	}

	t.Run("refused", func(t *testing.T) {
		tr := startRelay(t, nil)
		c := tr.dial(t)
		live(t, tr, c, []byte(`["COUNT","s",{"kinds":"x"}]`), "invalid:") // malformed
		live(t, tr, c, []byte(`["COUNT","s",{"limit":-1}]`), "invalid:")  // well-formed, refused by the compiler
		live(t, tr, c, []byte(`["COUNT","s",{"kinds":[30300]}]`), "auth-required:")
	})
	t.Run("rate-limited", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) { c.ReqRate, c.ReqBurst = 1e-9, 1 }) // one REQ or COUNT, then none
		live(t, tr, tr.dial(t), []byte(`["COUNT","s",{"kinds":[1]}]`), "rate-limited:")
	})
	t.Run("failed", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) { c.QueryTimeout = 300 * time.Millisecond })
		var release func()
		defer func() { release() }()
		live(t, tr, tr.dial(t), []byte(`["COUNT","s",{"kinds":[1]}]`), "error:", func() {
			release = holdAll(t, tr.s.query) // the COUNT gets no connection within its timeout
		})
	})
}

// barrierNone checks that c's subscription sub receives nothing of what was enqueued so far, with
// an EVENT's OK as the barrier (a REQ probe, as syncNone sends, may be rate-limited): Deliver has
// enqueued before it returns, and the OK comes after.
func barrierNone(t *testing.T, c *client, sub string) {
	t.Helper()
	sk, _ := testenv.NewKey()
	ev := signed(sk, 1, "barrier", nostr.Now())
	ev.Content = "tampered" // refused (id mismatch) without storing anything
	b, _ := json.Marshal([]any{"EVENT", ev})
	c.sendRaw(b)
	for {
		m := c.read()
		if c.verb(m) == "EVENT" && str(m[1]) == sub {
			t.Fatalf("%s received %s after its CLOSED", sub, joinRaw(m))
		}
		if c.verb(m) == "OK" && str(m[1]) == ev.ID {
			return
		}
	}
}
