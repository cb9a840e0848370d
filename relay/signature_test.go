package relay

import (
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"
)

func signedEvent(t *testing.T, content string) *nostr.Event {
	t.Helper()
	ev := &nostr.Event{Kind: 1, CreatedAt: nostr.Now(), Tags: nostr.Tags{}, Content: content}
	if err := ev.Sign(nostr.GeneratePrivateKey()); err != nil {
		t.Fatal(err)
	}
	return ev
}

// verifySignature takes the id as the message (checkShapeAndSignature checks the id first), and
// a parsed key it keeps must never let another key's signature pass.
func TestVerifySignature(t *testing.T) {
	a, b := signedEvent(t, "a"), signedEvent(t, "b")
	for i := range 2 { // the second time from the kept keys
		if !verifySignature(a) || !verifySignature(b) {
			t.Fatalf("round %d: a valid signature was refused", i)
		}
	}
	flip := func(s string, at int) string {
		c := byte('0')
		if s[at] == '0' {
			c = '1'
		}
		return s[:at] + string(c) + s[at+1:]
	}
	cases := map[string]func(ev *nostr.Event){
		"sig changed":          func(ev *nostr.Event) { ev.Sig = flip(ev.Sig, 10) },
		"id changed":           func(ev *nostr.Event) { ev.ID = flip(ev.ID, 3) },
		"another author's key": func(ev *nostr.Event) { ev.PubKey = b.PubKey },
		"key not on the curve": func(ev *nostr.Event) { ev.PubKey = strings.Repeat("f", 64) },
		"sig not hex":          func(ev *nostr.Event) { ev.Sig = strings.Repeat("z", 128) },
		"sig too long":         func(ev *nostr.Event) { ev.Sig += "00" },
		"key too short":        func(ev *nostr.Event) { ev.PubKey = ev.PubKey[:62] },
	}
	for name, change := range cases {
		ev := *a
		change(&ev)
		if verifySignature(&ev) {
			t.Errorf("%s: accepted", name)
		}
	}
}
