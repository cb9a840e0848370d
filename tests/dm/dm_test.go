package dm

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestOpenIsIdempotentBySet(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	if again := e.open(a, b); again != ch {
		t.Fatalf("re-open gave %s, want %s", again, ch)
	}
	if other := e.open(b, a); other != ch {
		t.Fatalf("open by the other participant gave %s, want %s", other, ch)
	}
	// Duplicate p tags and the opener listed among the p tags name the same set.
	ok, msg := e.accept(a.Event(t, 41010, nostr.Tags{{"p", b.PK}, {"p", b.PK}, {"p", a.PK}}, ""))
	if !ok || !strings.Contains(msg, ch) || !strings.Contains(msg, `"created": false`) && !strings.Contains(msg, `"created":false`) {
		t.Fatalf("dedup open: %v %q", ok, msg)
	}
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.members WHERE channel_id=$1`, ch); n != 2 {
		t.Fatalf("members: %d", n)
	}
}

func TestOpenParticipantBounds(t *testing.T) {
	e := newEnv(t)
	a := newUser()
	others := func(n int) nostr.Tags {
		var tags nostr.Tags
		for i := 0; i < n; i++ {
			tags = append(tags, nostr.Tag{"p", newUser().PK})
		}
		return tags
	}
	if ok, msg := e.accept(a.Event(t, 41010, others(8), "")); !ok {
		t.Fatalf("9 participants rejected: %q", msg)
	}
	for _, n := range []int{0, 9} {
		ok, msg := e.accept(a.Event(t, 41010, others(n), ""))
		if ok || !strings.HasPrefix(msg, "invalid:") {
			t.Fatalf("%d others: got %v %q, want invalid:", n, ok, msg)
		}
	}
	ok, msg := e.accept(a.Event(t, 41010, nostr.Tags{{"p", "not-hex"}}, ""))
	if ok || !strings.HasPrefix(msg, "invalid:") {
		t.Fatalf("bad p: %v %q", ok, msg)
	}
}

func TestResurfacingMatrix(t *testing.T) {
	for _, kind := range []int{9, 40002, 45001, 45003} {
		e := newEnv(t)
		a, b, c := newUser(), newUser(), newUser()
		ch := e.open(a, b, c)
		e.hide(b, ch)
		e.hide(c, ch)
		e.hide(a, ch)
		e.msg(a, ch, kind)
		if e.hidden(b, ch) || e.hidden(c, ch) {
			t.Fatalf("kind %d did not resurface the DM for the other participants", kind)
		}
		if !e.hidden(a, ch) {
			t.Fatalf("kind %d touched the sender's own hide", kind)
		}
		e.assertAgree(b, 2)
		e.assertAgree(c, 2)
		e.assertAgree(a, 1)
	}
}

func TestOtherKindsNeverResurface(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	target := e.msg(a, ch, 9)
	e.hide(b, ch)
	cases := []*nostr.Event{
		a.Event(t, 7, nostr.Tags{{"h", ch}, {"e", target.ID}}, "+"),
		a.Event(t, 40003, nostr.Tags{{"h", ch}, {"e", target.ID}}, "edit"),
		a.Event(t, 40099, nostr.Tags{{"h", ch}}, "system"),
		a.Event(t, 20001, nostr.Tags{{"h", ch}}, "typing"),
		a.Event(t, 5, nostr.Tags{{"h", ch}, {"e", target.ID}}, ""),
	}
	for _, ev := range cases {
		if ok, msg := e.accept(ev); !ok {
			t.Fatalf("kind %d rejected: %q", ev.Kind, msg)
		}
		if !e.hidden(b, ch) {
			t.Fatalf("kind %d resurfaced the DM", ev.Kind)
		}
	}
	e.assertAgree(b, 1)
}

func TestDuplicateMessageChangesNothing(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	e.hide(b, ch)
	m := e.msg(a, ch, 9)
	e.hide(b, ch)
	ok, msg := e.accept(m)
	if !ok || !strings.HasPrefix(msg, "duplicate:") {
		t.Fatalf("replay: %v %q", ok, msg)
	}
	if !e.hidden(b, ch) {
		t.Fatal("a replayed message resurfaced the DM")
	}
	e.assertAgree(b, 3)
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.events WHERE id=$1`, m.ID); n != 1 {
		t.Fatalf("stored %d times", n)
	}
	// Command replays change nothing either.
	hideEv := b.Event(t, 41012, nostr.Tags{{"h", ch}}, "")
	e.accept(hideEv)
	e.msg(a, ch, 9)
	if e.hidden(b, ch) {
		t.Fatal("message did not resurface")
	}
	if ok, msg := e.accept(hideEv); !ok || !strings.HasPrefix(msg, "duplicate:") {
		t.Fatalf("hide replay: %v %q", ok, msg)
	}
	if e.hidden(b, ch) {
		t.Fatal("a replayed hide hid the DM again")
	}
}

func TestReopenUnhidesForOpenerOnly(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	e.hide(a, ch)
	e.hide(b, ch)
	if again := e.open(b, a); again != ch {
		t.Fatal("re-open returned another channel")
	}
	if e.hidden(b, ch) {
		t.Fatal("re-open did not make the DM visible for the opener")
	}
	if !e.hidden(a, ch) {
		t.Fatal("re-open touched the other participant's hide")
	}
	e.assertAgree(b, 2)
	e.assertAgree(a, 1)
}

func TestAddMemberOpensNewDM(t *testing.T) {
	e := newEnv(t)
	a, b, c, x := newUser(), newUser(), newUser(), newUser()
	ch := e.open(a, b)
	add := func(u user) (bool, string) {
		return e.accept(u.Event(t, 41011, nostr.Tags{{"h", ch}, {"p", c.PK}}, ""))
	}
	ok, msg := add(a)
	if !ok || !strings.HasPrefix(msg, "response:") {
		t.Fatalf("add: %v %q", ok, msg)
	}
	var resp struct {
		ChannelID string `json:"channel_id"`
		Created   bool   `json:"created"`
	}
	_ = json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp)
	if resp.ChannelID == ch || !resp.Created {
		t.Fatalf("add member must open a new DM: %+v", resp)
	}
	if got := e.open(c, a, b); got != resp.ChannelID {
		t.Fatalf("the larger set is %s, open gave %s", resp.ChannelID, got)
	}
	ok, msg = add(b)
	if !ok || !strings.Contains(msg, resp.ChannelID) {
		t.Fatalf("second add: %v %q", ok, msg)
	}
	if ok, msg := add(x); ok || !strings.HasPrefix(msg, "restricted:") {
		t.Fatalf("non-member add: %v %q", ok, msg)
	}
}

func TestNonMembersAreRestricted(t *testing.T) {
	e := newEnv(t)
	a, b, x := newUser(), newUser(), newUser()
	ch := e.open(a, b)
	for _, ev := range []*nostr.Event{
		x.Event(t, 41012, nostr.Tags{{"h", ch}}, ""),
		x.Event(t, 9, nostr.Tags{{"h", ch}}, "intruder"),
		a.Event(t, 9, nostr.Tags{{"h", "00000000-0000-0000-0000-000000000000"}}, "nowhere"),
		a.Event(t, 9, nostr.Tags{{"h", "not-a-uuid"}}, "nowhere"),
	} {
		ok, msg := e.accept(ev)
		if ok || !strings.HasPrefix(msg, "restricted:") {
			t.Fatalf("kind %d: got %v %q, want restricted:", ev.Kind, ok, msg)
		}
		if testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.events WHERE id=$1`, ev.ID) != 0 {
			t.Fatal("a restricted event was stored")
		}
	}
	e.assertAgree(a, 0)
	e.assertAgree(b, 0)
}

func TestManyParticipantsResurface(t *testing.T) {
	e := newEnv(t)
	users := make([]user, 9)
	for i := range users {
		users[i] = newUser()
	}
	ch := e.open(users[0], users[1:]...)
	for _, u := range users[1:] {
		e.hide(u, ch)
	}
	e.msg(users[0], ch, 9)
	for _, u := range users[1:] {
		if e.hidden(u, ch) {
			t.Fatal("a participant stayed hidden")
		}
		e.assertAgree(u, 2)
	}
}

func TestRelaySignedMessageUsesActor(t *testing.T) {
	e := newEnv(t)
	a, b, x := newUser(), newUser(), newUser()
	ch := e.open(a, b)
	e.hide(a, ch)
	e.hide(b, ch)
	relay := user{SK: relaySK, PK: relayPK}
	ok, msg := e.accept(relay.Event(t, 9, nostr.Tags{{"h", ch}, {"actor", a.PK}}, "workflow says hi"))
	if !ok {
		t.Fatalf("relay-signed: %q", msg)
	}
	if e.hidden(b, ch) {
		t.Fatal("relay-signed message did not resurface for the other participant")
	}
	if !e.hidden(a, ch) {
		t.Fatal("relay-signed message touched the actor's own hide")
	}
	// No actor: the first p tag is the sender.
	e.hide(b, ch)
	if ok, msg := e.accept(relay.Event(t, 9, nostr.Tags{{"h", ch}, {"p", b.PK}}, "for b")); !ok {
		t.Fatalf("relay-signed with p: %q", msg)
	}
	if !e.hidden(b, ch) || e.hidden(a, ch) {
		t.Fatal("with only a p tag, that p is the sender")
	}
	// The actor must be a member.
	if ok, msg := e.accept(relay.Event(t, 9, nostr.Tags{{"h", ch}, {"actor", x.PK}}, "x")); ok || !strings.HasPrefix(msg, "restricted:") {
		t.Fatalf("non-member actor: %v %q", ok, msg)
	}
	// On a client-signed event the actor tag does not count: the sender is its pubkey.
	e.hide(b, ch)
	e.hide(a, ch)
	if ok, msg := e.accept(a.Event(t, 9, nostr.Tags{{"h", ch}, {"actor", b.PK}}, "spoof")); !ok {
		t.Fatalf("client message with actor tag: %q", msg)
	}
	if e.hidden(b, ch) || !e.hidden(a, ch) {
		t.Fatal("client-signed actor tag changed who the sender is")
	}
}

func TestOperatorHideFromSQL(t *testing.T) {
	e := newEnv(t)
	a, b, x := newUser(), newUser(), newUser()
	ch := e.open(a, b)
	var changed bool
	if err := e.pool.QueryRow(context.Background(), `SELECT buzz.hide_dm($1, $2)`, b.PK, ch).Scan(&changed); err != nil || !changed {
		t.Fatalf("hide_dm: %v %v", changed, err)
	}
	if testenv.MustScalar[bool](t, e.pool, `SELECT buzz.hide_dm($1, $2)`, b.PK, ch) {
		t.Fatal("hiding twice reported a change")
	}
	e.assertAgree(b, 1)
	if err := e.pool.QueryRow(context.Background(), `SELECT buzz.unhide_dm($1, $2)`, b.PK, ch).Scan(&changed); err != nil || !changed {
		t.Fatalf("unhide_dm: %v %v", changed, err)
	}
	e.assertAgree(b, 2)
	// A raw UPDATE converges the same way: the trigger bumps the generation.
	if _, err := e.pool.Exec(context.Background(), `UPDATE buzz.members SET hidden_at = now() WHERE channel_id=$1 AND pubkey=$2`, ch, b.PK); err != nil {
		t.Fatal(err)
	}
	e.assertAgree(b, 3)
	// Moving the hidden row to another viewer (a raw UPDATE of pubkey) changes two hidden sets:
	// both generations move.
	e.assertAgree(x, 0)
	if _, err := e.pool.Exec(context.Background(), `UPDATE buzz.members SET pubkey = $3 WHERE channel_id=$1 AND pubkey=$2`, ch, b.PK, x.PK); err != nil {
		t.Fatal(err)
	}
	e.assertAgree(b, 4)
	e.assertAgree(x, 1)
	if _, err := e.pool.Exec(context.Background(), `UPDATE buzz.members SET pubkey = $3 WHERE channel_id=$1 AND pubkey=$2`, ch, x.PK, b.PK); err != nil {
		t.Fatal(err)
	}
	_, err := e.pool.Exec(context.Background(), `SELECT buzz.hide_dm($1, $2)`, x.PK, ch)
	if err == nil || !strings.Contains(err.Error(), "restricted:") {
		t.Fatalf("non-member hide_dm: %v", err)
	}
}
