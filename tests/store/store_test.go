// Package store tests buzz.accept_event's storage semantics (NIP-01 replacement, NIP-09, NIP-40)
// directly against PostgreSQL, including races driven from two connections.
package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

type env struct {
	t    *testing.T
	url  string
	pool *pgxpool.Pool
}

func newEnv(t *testing.T) *env {
	url := testenv.DB(t)
	return &env{t: t, url: url, pool: testenv.Pool(t, url)}
}

func (e *env) accept(ev *nostr.Event) (bool, string) {
	e.t.Helper()
	ok, msg, err := store.Accept(context.Background(), e.pool, ev)
	if err != nil {
		e.t.Fatalf("accept: %v", err)
	}
	return ok, msg
}

// mustAccept accepts ev and fails the test unless it got OK true.
func (e *env) mustAccept(ev *nostr.Event) {
	e.t.Helper()
	if ok, msg := e.accept(ev); !ok {
		e.t.Fatalf("got OK false %q, want true", msg)
	}
}

// stored reports whether id is in buzz.events; a failed query fails the test (it must never read
// as "not stored", which is what the negative checks want).
func (e *env) stored(id string) bool {
	e.t.Helper()
	return mustInt(e.t, e.pool, `SELECT count(*) FROM buzz.events WHERE id=$1`, id) == 1
}

// heads returns the ids stored for an address; a failed query fails the test.
func (e *env) heads(kind int, pubkey, d string) []string {
	e.t.Helper()
	return testenv.MustColumn[string](e.t, e.pool,
		`SELECT id FROM buzz.events WHERE kind=$1 AND pubkey=$2 AND coalesce(d_tag,'')=$3`, kind, pubkey, d)
}

// mustInt runs a query returning one integer; any error fails the test.
func mustInt(t *testing.T, q testenv.Querier, sql string, args ...any) int {
	t.Helper()
	return testenv.MustInt(t, q, sql, args...)
}

// race accepts first in an open transaction on one connection, then second on another, waits
// until the second blocks on a lock (or finishes), commits the first, then the second. It returns
// the second's verdict and whether it had to wait.
func (e *env) race(first, second *nostr.Event) (ok2 bool, msg2 string, blocked bool) {
	e.t.Helper()
	s1, s2 := testenv.NewSession(e.t, e.url, "first"), testenv.NewSession(e.t, e.url, "second")
	s1.Begin()
	s1.MustAccept(first)
	s2.Begin()
	var err2 error
	done := testenv.Async(func() { ok2, msg2, err2 = s2.Accept(second) })
	blocked = testenv.WaitBlockedOrDone(e.t, e.pool, s2.PID, done)
	s1.Commit()
	<-done
	if err2 != nil {
		e.t.Fatal(err2)
	}
	s2.Commit()
	return ok2, msg2, blocked
}

func expect(t *testing.T, ok bool, msg string, wantOK bool, prefix string) {
	t.Helper()
	if ok != wantOK || !strings.HasPrefix(msg, prefix) {
		t.Fatalf("got OK %v %q, want %v %q...", ok, msg, wantOK, prefix)
	}
}

func TestRegularAndDuplicate(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	ev := u.Event(t, 1, nil, "hello")
	e.mustAccept(ev)
	ok, msg := e.accept(ev)
	expect(t, ok, msg, true, "duplicate:")
	if !e.stored(ev.ID) {
		t.Fatal("not stored")
	}
}

func TestReplaceableNewerWinsOlderRejected(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	now := nostr.Now()
	for _, kind := range []int{0, 3, 10002} {
		v1 := u.EventAt(t, kind, nil, "v1", now-10)
		v2 := u.EventAt(t, kind, nil, "v2", now-5)
		e.mustAccept(v1)
		e.mustAccept(v2)
		ok, msg := e.accept(u.EventAt(t, kind, nil, "v0", now-20))
		expect(t, ok, msg, false, "duplicate: have newer")
		if h := e.heads(kind, u.PK, ""); len(h) != 1 || h[0] != v2.ID {
			t.Fatalf("kind %d heads %v, want [%s]", kind, h, v2.ID)
		}
	}
}

func TestAddressableKeyedByD(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	now := nostr.Now()
	a1 := u.EventAt(t, 30023, nostr.Tags{{"d", "a"}}, "a1", now-10)
	b1 := u.EventAt(t, 30023, nostr.Tags{{"d", "b"}}, "b1", now-10)
	a2 := u.EventAt(t, 30023, nostr.Tags{{"d", "a"}}, "a2", now-5)
	for _, ev := range []*nostr.Event{a1, b1, a2} {
		e.mustAccept(ev)
	}
	if h := e.heads(30023, u.PK, "a"); len(h) != 1 || h[0] != a2.ID {
		t.Fatalf("d=a heads %v", h)
	}
	if h := e.heads(30023, u.PK, "b"); len(h) != 1 || h[0] != b1.ID {
		t.Fatalf("d=b heads %v", h)
	}
	// No d tag means d = "".
	n1 := u.EventAt(t, 30023, nil, "n1", now-10)
	e.mustAccept(n1)
	if h := e.heads(30023, u.PK, ""); len(h) != 1 {
		t.Fatalf("empty d heads %v", h)
	}
}

// pairSameSecond returns two versions with equal created_at, lower id first.
func pairSameSecond(t *testing.T, u testenv.User, kind int, tags nostr.Tags) (low, high *nostr.Event) {
	at := nostr.Now() - 3
	x := u.EventAt(t, kind, tags, "x", at)
	y := u.EventAt(t, kind, tags, "y", at)
	if x.ID < y.ID {
		return x, y
	}
	return y, x
}

func TestEqualCreatedAtKeepsLowestID(t *testing.T) {
	e := newEnv(t)
	for _, order := range []string{"low-first", "high-first"} {
		u := testenv.NewUser()
		low, high := pairSameSecond(t, u, 10000, nil)
		first, second := low, high
		if order == "high-first" {
			first, second = high, low
		}
		e.mustAccept(first)
		ok, msg := e.accept(second)
		if order == "low-first" {
			expect(t, ok, msg, false, "duplicate: have newer")
		} else {
			expect(t, ok, msg, true, "")
		}
		if h := e.heads(10000, u.PK, ""); len(h) != 1 || h[0] != low.ID {
			t.Fatalf("%s: heads %v, want lowest id %s", order, h, low.ID)
		}
	}
}

// Two writers of one address on two connections, started together: whichever commits first,
// exactly one head remains and it is the NIP-01 winner.
func TestReplaceableRaceTwoConnections(t *testing.T) {
	e := newEnv(t)
	for _, order := range []string{"winner-first", "loser-first"} {
		u := testenv.NewUser()
		low, high := pairSameSecond(t, u, 30000, nostr.Tags{{"d", "race"}})
		first, second := low, high
		if order == "loser-first" {
			first, second = high, low
		}
		ok2, msg2, blocked := e.race(first, second)
		if !blocked {
			t.Fatalf("%s: the second writer did not wait for the first", order)
		}
		if order == "winner-first" && (ok2 || msg2 != "duplicate: have newer") {
			t.Fatalf("loser after winner: %v %q", ok2, msg2)
		}
		if h := e.heads(30000, u.PK, "race"); len(h) != 1 || h[0] != low.ID {
			t.Fatalf("%s: heads %v, want [%s]", order, h, low.ID)
		}
	}
}

func TestDeletionByID(t *testing.T) {
	e := newEnv(t)
	u, other := testenv.NewUser(), testenv.NewUser()
	mine := u.Event(t, 1, nil, "delete me")
	theirs := other.Event(t, 1, nil, "not yours")
	e.mustAccept(mine)
	e.mustAccept(theirs)
	del := u.Event(t, 5, nostr.Tags{{"e", mine.ID}, {"e", theirs.ID}}, "")
	e.mustAccept(del)
	if e.stored(mine.ID) {
		t.Fatal("own event not deleted")
	}
	if !e.stored(theirs.ID) {
		t.Fatal("someone else's event was deleted")
	}
	ok, msg := e.accept(mine)
	expect(t, ok, msg, false, "blocked: deleted")
	if e.stored(mine.ID) {
		t.Fatal("a deleted id came back")
	}
	// Deleting an id not seen yet still keeps it out later.
	future := u.Event(t, 1, nil, "later")
	e.mustAccept(u.Event(t, 5, nostr.Tags{{"e", future.ID}}, ""))
	ok, msg = e.accept(future)
	expect(t, ok, msg, false, "blocked: deleted")
}

func TestDeletionByAddressStopsAtCreatedAt(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	now := nostr.Now()
	old := u.EventAt(t, 30023, nostr.Tags{{"d", "post"}}, "old", now-100)
	e.mustAccept(old)
	if !e.stored(old.ID) {
		t.Fatal("the version to delete was not stored")
	}
	del := u.EventAt(t, 5, nostr.Tags{{"a", "30023:" + u.PK + ":post"}}, "", now-50)
	e.mustAccept(del)
	if e.stored(old.ID) {
		t.Fatal("a-deletion did not delete the older version")
	}
	ok, msg := e.accept(u.EventAt(t, 30023, nostr.Tags{{"d", "post"}}, "before deletion", now-60))
	expect(t, ok, msg, false, "blocked: deleted")
	newer := u.EventAt(t, 30023, nostr.Tags{{"d", "post"}}, "after deletion", now-10)
	e.mustAccept(newer)
	if !e.stored(newer.ID) {
		t.Fatal("a version newer than the deletion must be accepted")
	}
	// Someone else's a-deletion does nothing.
	other := testenv.NewUser()
	e.mustAccept(other.Event(t, 5, nostr.Tags{{"a", "30023:" + u.PK + ":post"}}, ""))
	if !e.stored(newer.ID) {
		t.Fatal("another author deleted the address")
	}
}

func TestExpiration(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	now := nostr.Now()
	ok, msg := e.accept(u.Event(t, 1, nostr.Tags{{"expiration", "1000"}}, "expired"))
	expect(t, ok, msg, false, "invalid: expired")
	ok, msg = e.accept(u.Event(t, 1, nostr.Tags{{"expiration", "soon"}}, "bad"))
	expect(t, ok, msg, false, "invalid:")
	live := u.Event(t, 1, nostr.Tags{{"expiration", strconv.FormatInt(int64(now+3600), 10)}}, "live")
	e.mustAccept(live)
	exp := testenv.MustScalar[int64](t, e.pool, `SELECT expires_at FROM buzz.events WHERE id=$1`, live.ID)
	if exp != int64(now+3600) {
		t.Fatalf("expires_at %d", exp)
	}
}

func TestRejectionsChangeNothing(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	cases := []struct {
		ev     *nostr.Event
		prefix string
	}{
		{u.EventAt(t, 1, nil, "future", nostr.Now()+3600), "invalid: created_at too far in future"},
		{u.Event(t, 22242, nostr.Tags{{"challenge", "x"}}, ""), "invalid:"},
		{u.Event(t, 30622, nostr.Tags{{"d", u.PK}, {"p", u.PK}}, ""), "restricted: relay-only kind"},
		{u.Event(t, 1059, nil, "wrap without p"), "invalid:"},
		// Index entries over PostgreSQL's limits (SQLSTATE 54000): a d value over the btree
		// maximum, and a tag value that does not compress under the GIN maximum.
		{u.Event(t, 30023, nostr.Tags{{"d", randomHex(3000)}}, ""), "invalid: a tag value is too long"},
		{u.Event(t, 1, nostr.Tags{{"r", randomHex(20000)}}, ""), "invalid: a tag value is too long"},
	}
	for _, c := range cases {
		ok, msg := e.accept(c.ev)
		expect(t, ok, msg, false, c.prefix)
		if e.stored(c.ev.ID) {
			t.Fatalf("kind %d stored although rejected", c.ev.Kind)
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, (n+1)/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

func TestEphemeralNeverStored(t *testing.T) {
	e := newEnv(t)
	u := testenv.NewUser()
	ev := u.Event(t, 20001, nil, "typing")
	e.mustAccept(ev)
	if e.stored(ev.ID) {
		t.Fatal("ephemeral event stored")
	}
}

func TestReadScopes(t *testing.T) {
	e := newEnv(t)
	u, v := testenv.NewUser(), testenv.NewUser()
	scope := func(id string) string {
		t.Helper()
		var s, p string
		testenv.MustScan(t, e.pool.QueryRow(context.Background(), `SELECT scope::text, coalesce(scope_p,'') FROM buzz.events WHERE id=$1`, id), &s, &p)
		return s + p
	}
	pub := u.Event(t, 1, nil, "public")
	wrap := u.Event(t, 1059, nostr.Tags{{"p", v.PK}}, "sealed")
	rem := u.Event(t, 30300, nostr.Tags{{"d", "r1"}}, "enc")
	for _, ev := range []*nostr.Event{pub, wrap, rem} {
		e.mustAccept(ev)
	}
	if scope(pub.ID) != "*" || scope(wrap.ID) != "p"+v.PK || scope(rem.ID) != "a" {
		t.Fatalf("scopes: %q %q %q", scope(pub.ID), scope(wrap.ID), scope(rem.ID))
	}
	// A deletion of a gated event is served only to its author.
	del := u.Event(t, 5, nostr.Tags{{"e", wrap.ID}}, "")
	e.mustAccept(del)
	if scope(del.ID) != "a" {
		t.Fatalf("deletion of a gated event has scope %q", scope(del.ID))
	}
	// Public only when every target is stored and public now: a second request for the deleted
	// gift wrap, or one naming an id or address unknown here, could be about a gated event.
	post := u.Event(t, 30023, nostr.Tags{{"d", "post"}}, "article")
	pub2 := u.Event(t, 1, nil, "public too")
	e.mustAccept(post)
	e.mustAccept(pub2)
	for _, c := range []struct {
		name  string
		tags  nostr.Tags
		scope string
	}{
		{"again, the gift wrap gone", nostr.Tags{{"e", wrap.ID}}, "a"},
		{"unknown id", nostr.Tags{{"e", randomHex(64)}}, "a"},
		{"public and unknown ids", nostr.Tags{{"e", pub.ID}, {"e", randomHex(64)}}, "a"},
		{"unknown address", nostr.Tags{{"a", "30023:" + u.PK + ":draft"}}, "a"},
		{"reminder address", nostr.Tags{{"a", "30300:" + u.PK + ":r1"}}, "a"},
		{"public address", nostr.Tags{{"a", "30023:" + u.PK + ":post"}}, "*"},
		{"public id", nostr.Tags{{"e", pub2.ID}}, "*"},
	} {
		d := u.Event(t, 5, c.tags, c.name)
		e.mustAccept(d)
		if got := scope(d.ID); got != c.scope {
			t.Errorf("deletion naming %s: scope %q, want %q", c.name, got, c.scope)
		}
	}
}

// A deletion racing the publication of the gated event it names: the event is not committed when
// the deletion's scope is decided, so the deletion must not be public.
func TestDeletionOfUncommittedGatedEventIsNotPublic(t *testing.T) {
	e := newEnv(t)
	u, v := testenv.NewUser(), testenv.NewUser()
	wrap := u.Event(t, 1059, nostr.Tags{{"p", v.PK}}, "sealed")
	del := u.Event(t, 5, nostr.Tags{{"e", wrap.ID}}, "")
	ok, msg, _ := e.race(wrap, del)
	expect(t, ok, msg, true, "")
	var s string
	if err := e.pool.QueryRow(context.Background(), `SELECT scope::text FROM buzz.events WHERE id = $1`, del.ID).Scan(&s); err != nil {
		t.Fatal(err)
	}
	if s != "a" {
		t.Fatalf("deletion of an in-flight gift wrap stored with scope %q, want author-only", s)
	}
	if e.stored(wrap.ID) {
		t.Fatal("the gift wrap survived its deletion")
	}
}

// An event and its deletion committing at the same time: whichever commits first, the event
// does not stay stored. Both orders, on two connections.
func TestDeletionRacesPublication(t *testing.T) {
	e := newEnv(t)
	for _, order := range []string{"event-first", "deletion-first"} {
		u := testenv.NewUser()
		ev := u.Event(t, 1, nil, "racing "+order)
		del := u.Event(t, 5, nostr.Tags{{"e", ev.ID}}, "")
		first, second := ev, del
		if order == "deletion-first" {
			first, second = del, ev
		}
		ok2, msg2, blocked := e.race(first, second)
		if !blocked {
			t.Errorf("%s: the second transaction did not wait for the first", order)
		}
		if e.stored(ev.ID) {
			t.Fatalf("%s: the deleted event is stored (second: %v %q)", order, ok2, msg2)
		}
		if order == "deletion-first" && (ok2 || msg2 != "blocked: deleted") {
			t.Fatalf("publishing a deleted id: %v %q", ok2, msg2)
		}
	}
}

// A kind 5 naming someone else's id is accepted and deletes nothing; it must not take the place of
// the author's own tombstone, or the author's later deletion would not keep the id out.
func TestDeletionTombstonePerAuthor(t *testing.T) {
	e := newEnv(t)
	alice, mallory := testenv.NewUser(), testenv.NewUser()
	note := alice.Event(t, 1, nil, "mine")
	unseen := alice.Event(t, 1, nil, "not published yet")
	e.mustAccept(note)
	e.mustAccept(mallory.Event(t, 5, nostr.Tags{{"e", note.ID}, {"e", unseen.ID}}, ""))
	if !e.stored(note.ID) {
		t.Fatal("someone else's deletion deleted the note")
	}
	e.mustAccept(alice.Event(t, 5, nostr.Tags{{"e", note.ID}, {"e", unseen.ID}}, ""))
	if e.stored(note.ID) {
		t.Fatal("the author's deletion did not delete the note")
	}
	for _, ev := range []*nostr.Event{note, unseen} {
		ok, msg := e.accept(ev)
		expect(t, ok, msg, false, "blocked: deleted")
		if e.stored(ev.ID) {
			t.Fatalf("%s came back after its author deleted it", ev.Content)
		}
	}
	// Mallory's own tombstone changes nothing for events of hers that she never deleted.
	hers := mallory.Event(t, 1, nil, "hers")
	e.mustAccept(hers)
}

// An event names at most one channel: membership is checked for one h value, and the read gate and
// resurfacing follow it, so a second value would place the message in a channel the author is
// not in (#h history) unchecked.
func TestEventNamesAtMostOneChannel(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, v, f := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()
	openDM := func(opener, other string) string {
		var ch string
		if err := e.pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, opener, other).Scan(&ch); err != nil {
			t.Fatal(err)
		}
		return ch
	}
	dm1, dm2 := openDM(a.PK, v.PK), openDM(v.PK, f.PK)
	before := mustInt(t, e.pool, `SELECT count(*) FROM buzz.events`)
	for _, tags := range []nostr.Tags{
		{{"h", dm1}, {"h", dm2}},
		{{"h", dm1}, {"h", "not-a-channel"}},
		{{"h", dm2}, {"h", dm1}},
	} {
		ev := a.Event(t, 9, tags, "two channels")
		ok, msg := e.accept(ev)
		expect(t, ok, msg, false, "invalid: an event names at most one channel")
	}
	if after := mustInt(t, e.pool, `SELECT count(*) FROM buzz.events`); after != before {
		t.Fatalf("rejected events changed the store: %d rows, want %d", after, before)
	}
	// The same channel twice is still one channel.
	ev := a.Event(t, 9, nostr.Tags{{"h", dm1}, {"h", dm1}}, "one channel, named twice")
	e.mustAccept(ev)
	if !e.stored(ev.ID) {
		t.Fatal("a message naming its channel twice was not stored")
	}
}

// accept_event's own shape checks (for psql callers, which skip the relay's): ids, pubkeys and
// signatures must be lowercase hex of the right length; anything else is invalid and stores nothing.
func TestShapeChecksForSQLCallers(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	u := testenv.NewUser()
	base := u.Event(t, 1, nil, "shape")
	raw := func(mut func(m map[string]any)) string {
		b, _ := json.Marshal(base)
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		mut(m)
		out, _ := json.Marshal(m)
		return string(out)
	}
	sig := base.Sig
	for name, mut := range map[string]func(m map[string]any){
		"sig 127 chars":   func(m map[string]any) { m["sig"] = sig[:127] },
		"sig 129 chars":   func(m map[string]any) { m["sig"] = sig + "a" },
		"sig uppercase":   func(m map[string]any) { m["sig"] = strings.ToUpper(sig) },
		"sig non-hex":     func(m map[string]any) { m["sig"] = "g" + sig[1:] },
		"sig empty":       func(m map[string]any) { m["sig"] = "" },
		"sig missing":     func(m map[string]any) { delete(m, "sig") },
		"id 63 chars":     func(m map[string]any) { m["id"] = base.ID[:63] },
		"id uppercase":    func(m map[string]any) { m["id"] = strings.ToUpper(base.ID) },
		"pubkey non-hex":  func(m map[string]any) { m["pubkey"] = "z" + base.PubKey[1:] },
		"pubkey 65 chars": func(m map[string]any) { m["pubkey"] = base.PubKey + "0" },
		"id missing":      func(m map[string]any) { delete(m, "id") },
		"pubkey missing":  func(m map[string]any) { delete(m, "pubkey") },
		"sig a number":    func(m map[string]any) { m["sig"] = 7 },
	} {
		_, err := e.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, raw(mut))
		if msg, ok := store.ClientError(err); !ok || !strings.HasPrefix(msg, "invalid:") {
			t.Errorf("%s: err %v, want invalid:", name, err)
		}
	}
	if n := mustInt(t, e.pool, `SELECT count(*) FROM buzz.events WHERE pubkey = $1`, base.PubKey); n != 0 {
		t.Fatalf("%d rows stored by rejected calls", n)
	}
	e.mustAccept(base)
}
