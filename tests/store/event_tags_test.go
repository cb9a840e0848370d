package store

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// buzz.event_tags, the index #x filters walk, is kept by triggers on buzz.events (sql/0002_accept):
// a stored event has one row per 'x:value' key, an untagged one none, and every way an event
// leaves (NIP-09 by id and by address, replacement, the upkeep purge) takes its rows with it.
func TestEventTagsFollowEvents(t *testing.T) {
	url := testenv.FreshDB(t) // the retention rule below applies to every event of its database
	e := &env{t: t, url: url, pool: testenv.Pool(t, url)}
	ctx := context.Background()
	u, v := testenv.NewUser(), testenv.NewUser()
	keys := func(id string) string {
		t.Helper()
		return strings.Join(testenv.MustColumn[string](t, e.pool,
			`SELECT tagval FROM buzz.event_tags WHERE event_id = $1 ORDER BY tagval`, id), " ")
	}
	want := func(what string, ev *nostr.Event, k string) {
		t.Helper()
		if got := keys(ev.ID); got != k {
			t.Fatalf("%s: tag rows %q, want %q", what, got, k)
		}
	}
	now := nostr.Now()

	// Per-event path: keys once each, single-letter tags only, none for an untagged event.
	untagged := u.Event(t, 1, nil, "untagged")
	tagged := u.Event(t, 1, nostr.Tags{{"t", "a"}, {"t", "b"}, {"t", "a"}, {"p", v.PK}, {"title", "x"}}, "tagged")
	e.mustAccept(untagged)
	e.mustAccept(tagged)
	want("untagged", untagged, "")
	want("tagged", tagged, "p:"+v.PK+" t:a t:b")

	// Set-based path (accept_plain_run through accept_events).
	run := []*nostr.Event{u.Event(t, 1, nil, "run untagged"), u.Event(t, 1, nostr.Tags{{"t", "r"}}, "run tagged"),
		v.Event(t, 1, nostr.Tags{{"e", tagged.ID}, {"t", "r"}}, "run reply")}
	raw, _ := json.Marshal(run)
	for _, r := range testenv.MustColumn[bool](t, e.pool, `SELECT ok FROM buzz.accept_events($1::jsonb)`, string(raw)) {
		if !r {
			t.Fatal("accept_events refused a plain event")
		}
	}
	want("run untagged", run[0], "")
	want("run tagged", run[1], "t:r")
	want("run reply", run[2], "e:"+tagged.ID+" t:r")

	// NIP-09 by id: the event's rows go; the request's own e tag is indexed.
	del := u.Event(t, 5, nostr.Tags{{"e", tagged.ID}}, "")
	e.mustAccept(del)
	want("deleted by id", tagged, "")
	want("deletion request", del, "e:"+tagged.ID)

	// Replacement: the old head's rows go with it.
	old := u.EventAt(t, 10002, nostr.Tags{{"r", "wss://old"}}, "", now-20)
	e.mustAccept(old)
	newer := u.EventAt(t, 10002, nostr.Tags{{"r", "wss://new"}}, "", now-10)
	e.mustAccept(newer)
	want("replaced head", old, "")
	want("new head", newer, "r:wss://new")
	art1 := u.EventAt(t, 30023, nostr.Tags{{"d", "art"}, {"t", "long"}}, "v1", now-20)
	art2 := u.EventAt(t, 30023, nostr.Tags{{"d", "art"}, {"t", "long"}}, "v2", now-10)
	e.mustAccept(art1)
	e.mustAccept(art2)
	want("replaced addressable version", art1, "")
	want("addressable head", art2, "d:art t:long")

	// NIP-09 by address.
	e.mustAccept(u.Event(t, 5, nostr.Tags{{"a", "30023:" + u.PK + ":art"}}, ""))
	want("deleted by address", art2, "")

	// The upkeep purge (an operator's retention rule for old kind 1).
	stale := v.EventAt(t, 1, nostr.Tags{{"t", "stale"}, {"p", u.PK}}, "old", now-3600)
	e.mustAccept(stale)
	want("old event before the purge", stale, "p:"+u.PK+" t:stale")
	if _, err := e.pool.Exec(ctx, `INSERT INTO buzz.retention (name, kinds, max_age) VALUES ('tagidx', '{1}', '30 minutes')`); err != nil {
		t.Fatal(err)
	}
	purger := testenv.NewSession(t, url, "upkeep")
	var locked bool
	var purged int
	testenv.MustScan(t, purger.Conn.QueryRow(ctx, `SELECT buzz.upkeep_try_lock()`), &locked)
	testenv.MustScan(t, purger.Conn.QueryRow(ctx, `SELECT buzz.upkeep_purge('retention:tagidx', 100)`), &purged)
	if !locked || purged != 1 || e.stored(stale.ID) {
		t.Fatalf("purge: lock %v, %d rows removed, stale still stored %v; want true, 1, false", locked, purged, e.stored(stale.ID))
	}
	want("purged", stale, "")

	// And nothing else is out of step: the rows are exactly the stored events' keys.
	extra := testenv.MustInt(t, e.pool, `SELECT count(*) FROM (
		SELECT tagval, created_at, event_id FROM buzz.event_tags
		EXCEPT SELECT k, created_at, id FROM buzz.events, unnest(tagvals) k) x`)
	missing := testenv.MustInt(t, e.pool, `SELECT count(*) FROM (
		SELECT k, created_at, id FROM buzz.events, unnest(tagvals) k
		EXCEPT SELECT tagval, created_at, event_id FROM buzz.event_tags) x`)
	if extra != 0 || missing != 0 {
		t.Fatalf("event_tags: %d rows of no stored event's key, %d keys without a row", extra, missing)
	}

	// buzzpg never updates an event; an UPDATE from psql that changes the keys moves the rows, and
	// a TRUNCATE empties the index with the table.
	if _, err := e.pool.Exec(ctx, `UPDATE buzz.events SET tagvals = '{t:moved}', created_at = created_at - 1 WHERE id = $1`, run[1].ID); err != nil {
		t.Fatal(err)
	}
	want("updated by hand", run[1], "t:moved")
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.event_tags t JOIN buzz.events x ON x.id = t.event_id
		WHERE t.event_id = $1 AND t.created_at = x.created_at`, run[1].ID); n != 1 {
		t.Fatalf("the updated event's row keeps its old created_at")
	}
	if _, err := e.pool.Exec(ctx, `TRUNCATE buzz.events`); err != nil {
		t.Fatal(err)
	}
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.event_tags`); n != 0 {
		t.Fatalf("%d tag rows after TRUNCATE buzz.events", n)
	}
}
