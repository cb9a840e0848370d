package relay

import (
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestAuth(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk1, pk1 := testenv.NewKey()
	sk2, pk2 := testenv.NewKey()
	send := func(ev nostr.Event) okReply {
		t.Helper()
		c.sendJSON("AUTH", ev)
		r := parseOK(t, c.expect("OK"))
		if r.id != ev.ID {
			t.Fatalf("OK for another id")
		}
		return r
	}
	refused := func(name string, ev nostr.Event, prefix string) {
		t.Helper()
		if r := send(ev); r.ok || !strings.HasPrefix(r.msg, prefix) {
			t.Fatalf("%s: %+v", name, r)
		}
	}
	now := nostr.Now()
	refused("wrong challenge", authEvent(sk1, "not-the-challenge", tr.url, now), "invalid:")
	refused("wrong relay URL", authEvent(sk1, c.challenge, "ws://elsewhere.example", now), "invalid:")
	refused("relay URL with a query", authEvent(sk1, c.challenge, tr.url+"/?x=evil", now), "invalid: relay URL")
	refused("relay URL with a fragment", authEvent(sk1, c.challenge, tr.url+"#evil", now), "invalid: relay URL")
	refused("relay URL with userinfo", authEvent(sk1, c.challenge, strings.Replace(tr.url, "ws://", "ws://evil.com@", 1), now), "invalid: relay URL")
	refused("20 minutes old", authEvent(sk1, c.challenge, tr.url, now-20*60), "invalid:")
	refused("20 minutes ahead", authEvent(sk1, c.challenge, tr.url, now+20*60), "invalid:")
	wrongKind := signed(sk1, 1, "", now, nostr.Tag{"relay", tr.url}, nostr.Tag{"challenge", c.challenge})
	refused("wrong kind", wrongKind, "invalid:")
	forged := authEvent(sk1, c.challenge, tr.url, now)
	forged.Sig = strings.Repeat("0", 128)
	refused("bad signature", forged, "invalid:")
	// The cheap checks run before the signature's: a replayed AUTH for another connection's
	// challenge is turned away without a verification (which the message order shows).
	foreign := authEvent(sk1, "another-connection", tr.url, now)
	foreign.Sig = strings.Repeat("0", 128)
	refused("foreign challenge, bad signature", foreign, "invalid: challenge does not match")
	if got := c.authedList(t, tr); len(got) != 0 {
		t.Fatalf("refused AUTHs authenticated %v", got)
	}

	// Success, with a trailing slash on the relay URL; then a second pubkey on the same connection.
	if r := send(authEvent(sk1, c.challenge, tr.url+"/", now)); !r.ok {
		t.Fatalf("AUTH: %+v", r)
	}
	if r := send(authEvent(sk2, c.challenge, tr.url, now-5*60)); !r.ok {
		t.Fatalf("second AUTH: %+v", r)
	}
	got := c.authedList(t, tr)
	if len(got) != 2 || got[0] != pk1 || got[1] != pk2 {
		t.Fatalf("authenticated %v", got)
	}
	// Both pubkeys read their author-only rows on this connection.
	r1 := signed(sk1, 30300, "x", now, nostr.Tag{"d", "a"})
	r2 := signed(sk2, 30300, "y", now-1, nostr.Tag{"d", "b"})
	c.mustPublish(r1)
	c.mustPublish(r2)
	sameIDs(t, "both authors", c.req("r", nostr.Filter{Kinds: []int{30300}, Authors: []string{pk1, pk2}}), r1, r2)

	// AUTH events are never stored.
	if n := tr.eventCount(t, "kind = 22242 AND pubkey = ANY($1)", []string{pk1, pk2}); n != 0 {
		t.Fatalf("%d auth events stored", n)
	}
	// And a 22242 sent as EVENT is invalid.
	if r := c.publish(authEvent(sk1, c.challenge, tr.url, now)); r.ok || !strings.HasPrefix(r.msg, "invalid:") {
		t.Fatalf("22242 as EVENT: %+v", r)
	}
}

// authedList reads the server side of the connection the client has (the only one open on tr
// for this test).
func (c *client) authedList(t *testing.T, tr *testRelay) []string {
	t.Helper()
	// A round trip first, so every earlier message was handled.
	c.req("authsync-"+nonce(), nostr.Filter{IDs: []string{randHex64()}})
	conns := tr.s.snapshotConns()
	if len(conns) != 1 {
		t.Fatalf("%d connections", len(conns))
	}
	return conns[0].authedList()
}

func TestProtectedEvents(t *testing.T) {
	tr := startRelay(t, nil)
	sk, pk := testenv.NewKey()
	skOther, _ := testenv.NewKey()
	prot := signed(sk, 1, "mine only", nostr.Now(), nostr.Tag{"-"})

	anon := tr.dial(t)
	if r := anon.publish(prot); r.ok || !strings.HasPrefix(r.msg, "auth-required:") {
		t.Fatalf("unauthenticated: %+v", r)
	}
	someoneElse := tr.dial(t)
	someoneElse.mustAuth(skOther, tr.url)
	// NIP-42: restricted, not auth-required, once a key is authenticated that is not allowed.
	if r := someoneElse.publish(prot); r.ok || !strings.HasPrefix(r.msg, "restricted:") {
		t.Fatalf("authenticated as someone else: %+v", r)
	}
	if n := tr.eventCount(t, "id = $1", prot.ID); n != 0 {
		t.Fatal("refused protected event was stored")
	}
	author := tr.dial(t)
	author.mustAuth(sk, tr.url)
	if r := author.publish(prot); !r.ok {
		t.Fatalf("author: %+v", r)
	}
	if n := tr.eventCount(t, "id = $1 AND pubkey = $2", prot.ID, pk); n != 1 {
		t.Fatal("accepted protected event not stored")
	}
}

// Without a relay URL there is nothing an AUTH could be bound to (a Host header is the client's
// choice): every AUTH is refused, one naming an empty relay URL too. serve refuses to start so.
func TestAuthRefusedWithoutRelayURL(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.RelayURL = "" })
	c := tr.dial(t)
	sk, _ := testenv.NewKey()
	for _, u := range []string{"", "ws://" + c.ws.RemoteAddr().String()} {
		ev := authEvent(sk, c.challenge, u, nostr.Now())
		c.sendJSON("AUTH", ev)
		if r := parseOK(t, c.expect("OK")); r.ok || !strings.HasPrefix(r.msg, "invalid: relay URL") {
			t.Fatalf("AUTH naming relay %q: %+v", u, r)
		}
	}
	if got := c.authedList(t, tr); len(got) != 0 {
		t.Fatalf("authenticated %v", got)
	}
}

// The relay tag names this relay exactly: scheme, host, port and path, after the normalisation
// NIP-42 allows (case of scheme and host, a default port written out, a trailing slash). A query,
// a fragment, userinfo or whitespace makes it another string a client never connected to.
func TestSameRelayURL(t *testing.T) {
	for _, tc := range []struct {
		ours, theirs string
		same         bool
	}{
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777", true},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/", true},
		{"ws://127.0.0.1:7777", "WS://127.0.0.1:7777", true},
		{"wss://relay.example.com", "wss://Relay.Example.COM/", true},
		{"wss://relay.example.com", "wss://relay.example.com:443", true},
		{"ws://relay.example.com:80/", "ws://relay.example.com", true},
		{"WSS://Relay.Example.com/nostr/", "wss://relay.example.com/nostr", true},
		{"wss://[2001:db8::1]:8443", "wss://[2001:DB8::1]:8443/", true},
		{" wss://relay.example.com ", "wss://relay.example.com", true}, // the operator's value, as config reads it

		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/?x=evil", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777?x=evil", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/?", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/#evil", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777#evil", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777#", false},
		{"ws://127.0.0.1:7777", "ws://evil.com@127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", "ws://user:pass@127.0.0.1:7777/", false},
		{"ws://127.0.0.1:7777", "ws://@127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", " ws://127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777 ", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/\n", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777\t", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7778", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1", false},
		{"ws://127.0.0.1:7777", "wss://127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", "http://127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", "ws:127.0.0.1:7777", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777/other", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.1:7777//", false},
		{"ws://127.0.0.1:7777", "ws://127.0.0.2:7777", false},
		{"ws://127.0.0.1:7777", "", false},
		{"wss://relay.example.com/nostr", "wss://relay.example.com/NOSTR", false},
		{"wss://relay.example.com/nostr", "wss://relay.example.com", false},
		{"wss://relay.example.com/nostr", "wss://relay.example.com:444/nostr", false},
		{"wss://relay.example.com", "wss://relay.example.com.", false},
	} {
		if got := sameRelayURL(tc.theirs, tc.ours); got != tc.same {
			t.Errorf("sameRelayURL(%q, %q) = %v, want %v", tc.theirs, tc.ours, got, tc.same)
		}
	}
}
