package relay

import (
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Tag filters walk buzz.event_tags (filter_sql.go): one walk per value of a multi-value
// condition, probes for the other letters. An event that carries several of the values, or the
// same value twice, comes back once, takes one slot of the limit, and is counted once.
func TestTagFiltersReturnEachEventOnce(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	skA, pkA := testenv.NewKey()
	skB, _ := testenv.NewKey()
	n := nonce() // unique per run: the package database is shared by tests
	X, Y, Z := "x-"+n, "y-"+n, "z-"+n
	P, Q := randHex64(), randHex64()
	base := int64(nostr.Now()) - 10000
	at := func(d int64) nostr.Timestamp { return nostr.Timestamp(base + d) }
	tag := func(k, v string) nostr.Tag { return nostr.Tag{k, v} }

	a := signed(skA, 1, "a", at(1), tag("t", X), tag("t", Y), tag("p", P))
	b := signed(skB, 1, "b", at(2), tag("t", X))
	cc := signed(skA, 1, "c", at(3), tag("t", Y), tag("p", P))
	d := signed(skB, 1, "d", at(4), tag("t", X), tag("t", X), tag("p", Q)) // one value twice
	e := signed(skA, 1, "e", at(5), tag("t", Z))
	f := signed(skA, 1, "f", at(6), tag("p", P))
	g := signed(skA, 1, "g", at(6)) // untagged, same second as f
	h := signed(skB, 7, "h", at(7), tag("t", X), tag("t", Y), tag("t", Z), tag("p", P), tag("p", Q))
	for _, ev := range []nostr.Event{a, b, cc, d, e, f, g, h} {
		c.mustPublish(ev)
	}
	XY, XYZ := []string{X, Y}, []string{X, Y, Z}
	cases := []struct {
		name string
		f    []nostr.Filter
		want []nostr.Event
		all  int // COUNT (it ignores limit), when it differs from len(want)
	}{
		{"#t two values", []nostr.Filter{{Tags: nostr.TagMap{"t": XY}}}, []nostr.Event{h, d, cc, b, a}, 0},
		{"#t two values, limit", []nostr.Filter{{Tags: nostr.TagMap{"t": XY}, Limit: 3}}, []nostr.Event{h, d, cc}, 5},
		{"#t one value twice in the event", []nostr.Filter{{Tags: nostr.TagMap{"t": {X}}}}, []nostr.Event{h, d, b, a}, 0},
		{"#t three values and #p", []nostr.Filter{{Tags: nostr.TagMap{"t": XYZ, "p": {P}}}}, []nostr.Event{h, cc, a}, 0},
		{"#t and #p two values", []nostr.Filter{{Tags: nostr.TagMap{"t": {X}, "p": {P, Q}}}}, []nostr.Event{h, d, a}, 0},
		{"#t and #p both two values", []nostr.Filter{{Tags: nostr.TagMap{"t": {Y, Z}, "p": {P, Q}}}}, []nostr.Event{h, cc, a}, 0},
		{"#t two values, authors, kinds", []nostr.Filter{{Tags: nostr.TagMap{"t": XYZ}, Authors: []string{pkA}, Kinds: []int{1}}}, []nostr.Event{e, cc, a}, 0},
		{"#t two values, since and until", []nostr.Filter{{Tags: nostr.TagMap{"t": XY}, Since: ts(base + 2), Until: ts(base + 4)}}, []nostr.Event{d, cc, b}, 0},
		{"ids and #t two values", []nostr.Filter{{IDs: []string{a.ID, b.ID, e.ID}, Tags: nostr.TagMap{"t": XY}}}, []nostr.Event{b, a}, 0},
		{"two filters overlap", []nostr.Filter{{Tags: nostr.TagMap{"t": XY}}, {Tags: nostr.TagMap{"p": {P}}}}, []nostr.Event{h, f, d, cc, b, a}, 0},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sub := "tf" + string(rune('a'+i))
			sameIDs(t, "REQ", c.req(sub, tc.f...), tc.want...)
			c.sendJSON("CLOSE", sub)
			want := max(tc.all, len(tc.want))
			if got, closed := c.count(sub+"c", tc.f...); closed != "" || got != int64(want) {
				t.Fatalf("COUNT = %d (closed %q), want %d", got, closed, want)
			}
		})
	}
}
