package relay

import (
	"slices"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Deliver looks up an event's readers by authenticated pubkey instead of walking every
// connection: each scope still reaches exactly the connections that may read it, a connection
// authenticated as two readers gets one copy, and nobody else gets any.
func TestScopedDeliveryReachesItsReadersOnly(t *testing.T) {
	tr := startRelay(t, nil)
	alice := newParty(t, tr, true)
	bob := newParty(t, tr, true)
	carol := newParty(t, tr, true)
	anon := newParty(t, tr, false)
	both := tr.dial(t)
	both.mustAuth(alice.sk, tr.url)
	both.mustAuth(bob.sk, tr.url)
	ch := openDM(t, alice, bob.pk)
	_, stranger := testenv.NewKey()

	clients := map[string]*client{"alice": alice.c, "bob": bob.c, "carol": carol.c, "anon": anon.c, "both": both}
	tag := nonce()
	for _, c := range clients {
		c.req("s", nostr.Filter{Kinds: []int{1}, Tags: nostr.TagMap{"t": {tag}}})
	}
	all := []string{"alice", "bob", "carol", "anon", "both"}
	for _, tc := range []struct {
		what   string
		scope  evt.Scope
		author string
		want   []string
	}{
		{"p-scoped to alice", evt.Scope{Kind: evt.ScopeP, P: alice.pk}, carol.pk, []string{"alice", "both"}},
		{"author-scoped, bob's", evt.Scope{Kind: evt.ScopeAuthor}, bob.pk, []string{"bob", "both"}},
		{"DM of alice and bob", evt.Scope{Kind: evt.ScopeChannel, Channel: ch}, alice.pk, []string{"alice", "bob", "both"}},
		{"p-scoped to nobody connected", evt.Scope{Kind: evt.ScopeP, P: stranger}, carol.pk, nil},
		{"public", evt.Scope{Kind: evt.ScopePublic}, carol.pk, all},
		{"unknown scope", evt.Scope{Kind: 'x'}, carol.pk, nil},
	} {
		ev := nostr.Event{ID: randHex64(), PubKey: tc.author, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{{"t", tag}}}
		tr.s.DeliverEvent(evt.Delivery{Event: &ev, Scope: tc.scope})
		for _, name := range all {
			c := clients[name]
			if slices.Contains(tc.want, name) {
				if got := c.nextEvent("s"); got.ID != ev.ID {
					t.Fatalf("%s: %s got %s, want %s", tc.what, name, got.ID, ev.ID)
				}
			}
			syncNone(t, c, "s") // nothing (more): no second copy, nothing for a non-reader
		}
	}
}

// The index forgets a connection when it closes, and an AUTH handled after its connection was
// removed adds nothing back (it would pin the connection, and deliver to it, forever).
func TestAuthIndexForgetsClosedConnections(t *testing.T) {
	tr := startRelay(t, nil)
	alice := newParty(t, tr, true)
	bob := newParty(t, tr, true)
	both := tr.dial(t)
	both.mustAuth(alice.sk, tr.url)
	both.mustAuth(bob.sk, tr.url)
	bothConns := tr.s.connsOf([]string{alice.pk, bob.pk})
	if len(bothConns) != 3 {
		t.Fatalf("connections authenticated as alice or bob: %d, want 3 (each once)", len(bothConns))
	}

	both.ws.Close()
	alice.c.ws.Close()
	var gone []*conn
	for len(gone) < 2 {
		select {
		case cc := <-tr.closed:
			gone = append(gone, cc.c)
		case <-time.After(readTimeout):
			t.Fatal("closed connections were not removed")
		}
	}
	tr.s.mu.RLock()
	_, aliceLeft := tr.s.byPubkey[alice.pk]
	bobSet := len(tr.s.byPubkey[bob.pk])
	for _, set := range tr.s.byPubkey {
		for _, c := range gone {
			if _, ok := set[c]; ok {
				t.Errorf("closed connection %d still indexed", c.id)
			}
		}
	}
	tr.s.mu.RUnlock()
	if aliceLeft || bobSet != 1 {
		t.Fatalf("after closing: alice indexed %v, bob on %d connections; want false, 1", aliceLeft, bobSet)
	}

	_, late := testenv.NewKey()
	tr.s.indexAuth(gone[0], late)
	if got := tr.s.connsOf([]string{late}); len(got) != 0 {
		t.Fatalf("an AUTH after its connection closed indexed it: %d connections", len(got))
	}
}
