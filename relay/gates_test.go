package relay

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

type party struct {
	sk, pk string
	c      *client
}

func newParty(t *testing.T, tr *testRelay, authed bool) party {
	sk, pk := testenv.NewKey()
	c := tr.dial(t)
	if authed {
		c.mustAuth(sk, tr.url)
	}
	return party{sk, pk, c}
}

var dmReply = regexp.MustCompile(`^response:\{"channel_id":"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}","created":(true|false)\}$`)

// openDM opens a DM of a with others and returns its channel id.
func openDM(t *testing.T, a party, others ...string) string {
	t.Helper()
	tags := nostr.Tags{}
	for _, o := range others {
		tags = append(tags, nostr.Tag{"p", o})
	}
	ev := signed(a.sk, 41010, "", nostr.Now(), tags...)
	r := a.c.publish(ev)
	// docs/protocol.md's exact shape: a client may match the string, not parse it.
	if !r.ok || !dmReply.MatchString(r.msg) {
		t.Fatalf("DM open: %+v, want %s", r, dmReply)
	}
	var resp struct {
		ChannelID string `json:"channel_id"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(r.msg, "response:")), &resp); err != nil {
		t.Fatal(err)
	}
	return resp.ChannelID
}

// syncNone checks that c received nothing for sub before a fresh REQ's EOSE: everything a
// returned Deliver call enqueued precedes it.
func syncNone(t *testing.T, c *client, sub string) {
	t.Helper()
	probe := "probe-" + nonce()
	c.sendJSON("REQ", probe, nostr.Filter{IDs: []string{randHex64()}})
	for {
		m := c.read()
		if c.verb(m) == "EVENT" && str(m[1]) == sub {
			t.Fatalf("%s received %s", sub, joinRaw(m))
		}
		if c.verb(m) == "EOSE" && str(m[1]) == probe {
			c.sendJSON("CLOSE", probe)
			return
		}
	}
}

// countNone checks that a COUNT of filter f counts nothing for c: 0, or closed with restricted:
// (docs/protocol.md: a filter that can only match rows the connection may not read is closed).
func countNone(t *testing.T, c *client, what string, f nostr.Filter) {
	t.Helper()
	n, closed := c.count("cnt-"+nonce(), f)
	if closed == "" && n == 0 || strings.HasPrefix(closed, "restricted:") {
		return
	}
	t.Fatalf("%s: COUNT %d (closed %q), want 0 or restricted:", what, n, closed)
}

// countIs checks that a COUNT of f answers n.
func countIs(t *testing.T, c *client, what string, want int64, f nostr.Filter) {
	t.Helper()
	if n, closed := c.count("cnt-"+nonce(), f); n != want || closed != "" {
		t.Fatalf("%s: COUNT %d (closed %q), want %d", what, n, closed, want)
	}
}

// TestReadGates checks REQ, COUNT and live delivery for every gate class with a member, a
// non-member and an unauthenticated connection (I7).
func TestReadGates(t *testing.T) {
	tr := startRelay(t, nil)
	a := newParty(t, tr, true)     // DM member, author
	b := newParty(t, tr, true)     // DM member
	other := newParty(t, tr, true) // authenticated, not a member
	anon := newParty(t, tr, false) // not authenticated

	ch := openDM(t, a, b.pk)
	msg := signed(a.sk, 9, "secret", nostr.Now(), nostr.Tag{"h", ch})
	a.c.mustPublish(msg)
	scopeC := evt.Scope{Kind: evt.ScopeChannel, Channel: ch}

	t.Run("DM message by #h", func(t *testing.T) {
		f := nostr.Filter{Tags: nostr.TagMap{"h": {ch}}, Kinds: []int{9}}
		sameIDs(t, "member", b.c.req("h1", f), msg)
		if _, closed := other.c.reqOrClosed("h1", f); !strings.HasPrefix(closed, "restricted:") {
			t.Fatalf("non-member: %q", closed)
		}
		if _, closed := anon.c.reqOrClosed("h1", f); !strings.HasPrefix(closed, "auth-required:") {
			t.Fatalf("anonymous: %q", closed)
		}
		if n, closed := anon.c.count("h1c", f); !strings.HasPrefix(closed, "auth-required:") {
			t.Fatalf("anonymous COUNT: %d %q", n, closed)
		}
		if n, _ := b.c.count("h1c", f); n != 1 {
			t.Fatalf("member COUNT = %d", n)
		}
		countNone(t, other.c, "non-member COUNT by #h", f)
		// With the non-member's own DM beside it, the filter can match readable rows, so it is
		// answered (not closed) and the read gate inside the SQL alone keeps the message out.
		_, peer := testenv.NewKey()
		own := openDM(t, other, peer)
		ownMsg := signed(other.sk, 9, "mine", nostr.Now(), nostr.Tag{"h", own})
		other.c.mustPublish(ownMsg)
		both := nostr.Filter{Tags: nostr.TagMap{"h": {ch, own}}, Kinds: []int{9}}
		sameIDs(t, "non-member, #h with a DM of its own", other.c.req("h1o", both), ownMsg)
		countIs(t, other.c, "non-member COUNT, #h with a DM of its own", 1, both)
		countIs(t, b.c, "member COUNT, #h with someone else's DM", 1, both)
	})

	t.Run("DM message by author is silently omitted", func(t *testing.T) {
		f := nostr.Filter{Authors: []string{a.pk}, Kinds: []int{9}}
		if got := other.c.req("h2", f); len(got) != 0 {
			t.Fatalf("non-member got %d", len(got))
		}
		if got := anon.c.req("h2", f); len(got) != 0 {
			t.Fatalf("anonymous got %d", len(got))
		}
		if n, _ := anon.c.count("h2c", f); n != 0 {
			t.Fatalf("anonymous COUNT = %d", n)
		}
		countNone(t, other.c, "non-member COUNT by author", f)
		countIs(t, b.c, "member COUNT by author", 1, f)
		sameIDs(t, "member", b.c.req("h2b", f), msg)
	})

	t.Run("live DM delivery", func(t *testing.T) {
		f := nostr.Filter{Authors: []string{a.pk}, Kinds: []int{9}}
		sameIDs(t, "member's initial answer", b.c.req("live", f), msg)
		for _, p := range []party{other, anon} {
			if got := p.c.req("live", f); len(got) != 0 {
				t.Fatalf("a non-member's initial answer has %d events", len(got))
			}
		}
		m2 := signed(a.sk, 9, "again", nostr.Now(), nostr.Tag{"h", ch})
		tr.s.DeliverEvent(evt.Delivery{Event: &m2, Scope: scopeC})
		if got := b.c.nextEvent("live"); got.ID != m2.ID {
			t.Fatalf("member got %s", got.ID)
		}
		syncNone(t, other.c, "live")
		syncNone(t, anon.c, "live")
		// Authenticating later as a member opens the live gate on the same subscription.
		anon.c.mustAuth(b.sk, tr.url)
		m3 := signed(a.sk, 9, "third", nostr.Now(), nostr.Tag{"h", ch})
		tr.s.DeliverEvent(evt.Delivery{Event: &m3, Scope: scopeC})
		if got := anon.c.nextEvent("live"); got.ID != m3.ID {
			t.Fatalf("newly authenticated member got %s", got.ID)
		}
		for _, p := range []party{b, other, anon} {
			p.c.sendJSON("CLOSE", "live")
		}
	})

	t.Run("commands are author-only", func(t *testing.T) {
		f := nostr.Filter{Kinds: []int{41010}, Authors: []string{a.pk}}
		if got := a.c.req("cmd", f); len(got) != 1 {
			t.Fatalf("author got %d commands", len(got))
		}
		if _, closed := b.c.reqOrClosed("cmd", f); !strings.HasPrefix(closed, "restricted:") {
			t.Fatalf("other member: %q", closed)
		}
		if _, closed := anon2(t, tr).reqOrClosed("cmd", nostr.Filter{Kinds: []int{41010, 41012}}); !strings.HasPrefix(closed, "auth-required:") {
			t.Fatalf("anonymous: %q", closed)
		}
		// Mixed with a public kind the filter can match readable rows: answered, command omitted.
		if got := b.c.req("cmd2", nostr.Filter{Kinds: []int{41010, 1}, Authors: []string{a.pk}}); len(got) != 0 {
			t.Fatalf("other member got %d", len(got))
		}
	})

	t.Run("gift wraps to their p", func(t *testing.T) {
		gw := signed(a.sk, 1059, "wrapped", nostr.Now(), nostr.Tag{"p", b.pk})
		a.c.mustPublish(gw)
		f := nostr.Filter{Kinds: []int{1059}, Tags: nostr.TagMap{"p": {b.pk}}}
		sameIDs(t, "recipient", b.c.req("gw", f), gw)
		sameIDs(t, "recipient without #p", b.c.req("gw2", nostr.Filter{Kinds: []int{1059}, Authors: []string{a.pk}}), gw)
		if _, closed := other.c.reqOrClosed("gw", f); !strings.HasPrefix(closed, "restricted:") {
			t.Fatalf("other: %q", closed)
		}
		if _, closed := anon2(t, tr).reqOrClosed("gw", nostr.Filter{Kinds: []int{1059}}); !strings.HasPrefix(closed, "auth-required:") {
			t.Fatalf("anonymous: %q", closed)
		}
		if got := a.c.req("gw3", nostr.Filter{Kinds: []int{1059}, Authors: []string{a.pk}}); len(got) != 0 {
			t.Fatalf("sender is not the recipient, got %d", len(got))
		}
		if n, _ := b.c.count("gwc", f); n != 1 {
			t.Fatalf("recipient COUNT %d", n)
		}
		if n, _ := a.c.count("gwc", nostr.Filter{Kinds: []int{1059}, Authors: []string{a.pk}}); n != 0 {
			t.Fatalf("sender COUNT %d", n)
		}
	})

	t.Run("snapshots to their viewer only", func(t *testing.T) {
		snapV := tr.insertSnapshot(t, b.pk, ch)
		tr.insertSnapshot(t, other.pk)
		f := nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": {b.pk, other.pk}}}
		got := b.c.req("snap", f)
		if len(got) != 1 || got[0].ID != snapV.ID {
			t.Fatalf("viewer got %d snapshots", len(got))
		}
		if _, closed := a.c.reqOrClosed("snap", nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": {b.pk}}}); !strings.HasPrefix(closed, "restricted:") {
			t.Fatalf("someone else: %q", closed)
		}
		// COUNT: the viewer counts its own; someone else counts none, whatever #p says.
		countNone(t, a.c, "non-viewer COUNT", nostr.Filter{Kinds: []int{30622}})
		countNone(t, a.c, "non-viewer COUNT by #p", nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": {b.pk}}})
		countIs(t, b.c, "viewer COUNT", 1, nostr.Filter{Kinds: []int{30622}})
		// Live: only the viewer's connection gets it. The initial answers hold only what each
		// reader may read: the viewer's own snapshot, nothing for someone else.
		if got := a.c.req("snaplive", nostr.Filter{Kinds: []int{30622}}); len(got) != 0 {
			t.Fatalf("a non-viewer's initial answer has %d snapshots (first for %v)", len(got), got[0].Tags.GetFirst([]string{"p"}))
		}
		sameIDs(t, "viewer's initial answer", b.c.req("snaplive", nostr.Filter{Kinds: []int{30622}}), snapV)
		next := signed(tr.relay, 30622, "", nostr.Now()+1, nostr.Tag{"d", b.pk}, nostr.Tag{"p", b.pk})
		tr.s.DeliverEvent(evt.Delivery{Event: &next, Scope: evt.Scope{Kind: evt.ScopeP, P: b.pk}})
		if ev := b.c.nextEvent("snaplive"); ev.ID != next.ID {
			t.Fatal("viewer did not get its snapshot live")
		}
		syncNone(t, a.c, "snaplive")
	})

	t.Run("reminders author-only, due signals", func(t *testing.T) {
		rem := signed(a.sk, 30300, "enc", nostr.Now(), nostr.Tag{"d", "r-" + nonce()})
		a.c.mustPublish(rem)
		f := nostr.Filter{Kinds: []int{30300}}
		sameIDs(t, "author", a.c.req("rem", f), rem)
		if _, closed := anon2(t, tr).reqOrClosed("rem", f); !strings.HasPrefix(closed, "auth-required:") {
			t.Fatalf("anonymous: %q", closed)
		}
		if _, closed := b.c.reqOrClosed("rem", nostr.Filter{Kinds: []int{30300}, Authors: []string{a.pk}}); !strings.HasPrefix(closed, "restricted:") {
			t.Fatalf("other: %q", closed)
		}
		countNone(t, b.c, "non-author COUNT", f)
		countNone(t, b.c, "non-author COUNT by author", nostr.Filter{Kinds: []int{30300}, Authors: []string{a.pk}})
		countIs(t, a.c, "author COUNT", 1, f)
		// Due signal: re-sent although already seen, ignoring since/until; once per (id, stamp).
		// The initial answers: nothing stored after the hour ahead; nothing of a's for b.
		if got := a.c.req("due", nostr.Filter{Kinds: []int{30300}, Since: ts(int64(nostr.Now()) + 3600)}); len(got) != 0 {
			t.Fatalf("author's initial answer (since an hour ahead) has %d reminders", len(got))
		}
		if got := b.c.req("due", nostr.Filter{Kinds: []int{30300}}); len(got) != 0 {
			t.Fatalf("a non-author's initial answer has %d reminders (first by %.8s)", len(got), got[0].PubKey)
		}
		scope := evt.Scope{Kind: evt.ScopeAuthor}
		tr.s.DeliverDue(evt.Due{Event: &rem, Stamp: 7})
		tr.s.DeliverDue(evt.Due{Event: &rem, Stamp: 7})
		if ev := a.c.nextEvent("due"); ev.ID != rem.ID {
			t.Fatal("due not delivered")
		}
		syncNone(t, a.c, "due") // the second signal with the same stamp was dropped
		syncNone(t, b.c, "due")
		tr.s.DeliverDue(evt.Due{Event: &rem, Stamp: 8})
		if ev := a.c.nextEvent("due"); ev.ID != rem.ID {
			t.Fatal("a new stamp was not delivered")
		}
		// A plain (non-due) delivery of an id the subscription already has is dropped.
		a.c.req("rem-live", f)
		var xid int64
		if err := tr.pool.QueryRow(context.Background(), `SELECT xmin::text::bigint FROM buzz.events WHERE id = $1`, rem.ID).Scan(&xid); err != nil {
			t.Fatal(err)
		}
		tr.s.DeliverEvent(evt.Delivery{Event: &rem, Scope: scope, Xid: uint32(xid)})
		syncNone(t, a.c, "rem-live")
	})

	t.Run("a hide is its author's alone", func(t *testing.T) {
		// A 41012 carries the DM's h tag, yet nobody else learns that a member hid the DM.
		hide := signed(a.sk, 41012, "", nostr.Now(), nostr.Tag{"h", ch})
		a.c.mustPublish(hide)
		byH := nostr.Filter{Tags: nostr.TagMap{"h": {ch}}}
		for _, ev := range b.c.req("hide-b", byH) {
			if ev.ID == hide.ID {
				t.Fatal("another member read the hide through #h")
			}
		}
		byHKinds := nostr.Filter{Tags: nostr.TagMap{"h": {ch}}, Kinds: []int{9, 41012}}
		if n, closed := b.c.count("hide-bc", byHKinds); n != 1 || closed != "" { // the message, not the hide
			t.Fatalf("another member counts %d events of kinds 9/41012 under #h (%q), want 1", n, closed)
		}
		sameIDs(t, "author", a.c.req("hide-a", nostr.Filter{Kinds: []int{41012}, Authors: []string{a.pk}}), hide)
	})

	t.Run("deliveries to nobody's filters", func(t *testing.T) {
		// A public event no subscription's filter matches goes nowhere (and Deliver does not
		// fail); the same subscription does get a matching one, so it was live all along.
		if got := b.c.req("nobody", nostr.Filter{Kinds: []int{1}, Authors: []string{a.pk}}); len(got) != 0 {
			t.Fatalf("initial answer: %d events, want none (a stored no kind 1)", len(got))
		}
		x := signed(other.sk, 1, "x", nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&x))
		syncNone(t, b.c, "nobody")
		y := signed(a.sk, 1, "y", nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&y))
		if got := b.c.nextEvent("nobody"); got.ID != y.ID {
			t.Fatalf("the subscription got %s, want %s", got.ID, y.ID)
		}
		b.c.sendJSON("CLOSE", "nobody")
	})
}

func anon2(t *testing.T, tr *testRelay) *client { return tr.dial(t) }

// insertSnapshot stores a 30622 for viewer the way the publisher does (relay-signed, scope p).
func (tr *testRelay) insertSnapshot(t *testing.T, viewer string, hidden ...string) nostr.Event {
	t.Helper()
	tags := nostr.Tags{{"d", viewer}, {"p", viewer}}
	for _, h := range hidden {
		tags = append(tags, nostr.Tag{"h", h})
	}
	ev := signed(tr.relay, 30622, "", nostr.Now(), tags...)
	tagsJSON, _ := json.Marshal(ev.Tags)
	tv := []string{"d:" + viewer, "p:" + viewer}
	for _, h := range hidden {
		tv = append(tv, "h:"+h)
	}
	_, err := tr.pool.Exec(context.Background(),
		`INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals, scope, scope_p)
		 VALUES ($1,$2,$3,$4,$5::jsonb,$6,$7,$8,$9,'p',$8)`,
		ev.ID, ev.PubKey, int64(ev.CreatedAt), ev.Kind, string(tagsJSON), ev.Content, ev.Sig, viewer, tv)
	if err != nil {
		t.Fatal(err)
	}
	return ev
}
