package upkeep_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Expired events go once the grace period (5 minutes here) has passed, not before; a pass works
// in batches (2 rows) until none is left, and says so in buzz.upkeep_status() and the metrics.
func TestUpkeepExpiredPastGraceOnly(t *testing.T) {
	_, pool, u := setup(t)
	now := time.Now().Unix()
	var old []string
	for i := 0; i < 3; i++ {
		old = append(old, insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 400)}))
	}
	inGrace := insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 100)})
	future := insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now + 1000)})
	never := insert(t, pool, row{kind: 1, created: now - 1000})
	before := testutil.ToFloat64(metrics.UpkeepRowsPurged.WithLabelValues("expired"))

	mustLead(t, u)
	for _, id := range old {
		if stored(t, pool, id) {
			t.Errorf("event %s expired 400 s ago (grace 300 s) is still stored", id)
		}
	}
	for name, id := range map[string]string{"expired within the grace": inGrace, "expiring later": future, "without expiration": never} {
		if !stored(t, pool, id) {
			t.Errorf("event %s was purged", name)
		}
	}
	if got := testutil.ToFloat64(metrics.UpkeepRowsPurged.WithLabelValues("expired")) - before; got != 3 {
		t.Errorf("buzz_upkeep_rows_purged_total{rule=expired} grew by %v, want 3", got)
	}
	var removed, total, waiting int64
	var last *time.Time
	testenv.MustScan(t, pool.QueryRow(context.Background(),
		`SELECT last_run, last_removed, removed_total, waiting FROM buzz.upkeep_status() WHERE rule = 'expired'`),
		&last, &removed, &total, &waiting)
	if last == nil || removed != 3 || total != 3 || waiting != 0 {
		t.Errorf("upkeep_status expired: last_run %v, last_removed %d, removed_total %d, waiting %d; want set, 3, 3, 0", last, removed, total, waiting)
	}
}

// NIP-09 keeps holding: a rule covering every kind removes neither the deletion request nor the
// tombstone, and the deleted id is still refused afterwards.
func TestUpkeepKeepsTombstones(t *testing.T) {
	_, pool, u := setup(t)
	ctx := context.Background()
	author, other := testenv.NewUser(), testenv.NewUser()
	at := nostr.Timestamp(time.Now().Unix() - 1000)
	victim := author.EventAt(t, 1, nil, "to be deleted", at)
	del := author.EventAt(t, 5, nostr.Tags{{"e", victim.ID}}, "", at+1)
	bystander := other.EventAt(t, 1, nil, "old", at)
	for _, ev := range []*nostr.Event{victim, del, bystander} {
		if ok, msg := accept(t, pool, ev); !ok {
			t.Fatalf("accept kind %d: %s", ev.Kind, msg)
		}
	}
	rule(t, pool, `INSERT INTO buzz.retention (name, kind_min, kind_max, max_age) VALUES ('everything', 0, 65535, '1 minute')`)

	mustLead(t, u)
	if stored(t, pool, bystander.ID) {
		t.Fatal("the rule removed nothing (an old kind 1 is still stored): the test proves nothing")
	}
	if !stored(t, pool, del.ID) {
		t.Error("the deletion request (kind 5) was purged")
	}
	if n := testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.deleted_ids WHERE id = $1`, victim.ID); n != 1 {
		t.Errorf("tombstone rows for the deleted id: %d, want 1", n)
	}
	if ok, msg := accept(t, pool, victim); ok || msg != "blocked: deleted" {
		t.Errorf("deleted id published again after the purge: ok=%v %q, want blocked: deleted", ok, msg)
	}
	_ = ctx
}

func accept(t *testing.T, q *pgxpool.Pool, ev *nostr.Event) (bool, string) {
	t.Helper()
	raw, _ := json.Marshal(ev)
	var ok bool
	var msg string
	testenv.MustScan(t, q.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)), &ok, &msg)
	return ok, msg
}

// A kind-30622 age rule removes superseded snapshots but never a viewer's current head: the one
// visibility_state names (even when another relay key's snapshot is newer, as after a rotation
// between processes whose clocks differ), nor the newest of a viewer across relay keys.
func TestUpkeepKeeps30622Head(t *testing.T) {
	_, pool, u := setup(t)
	now := time.Now().Unix()
	v, w, x := hex64(), hex64(), hex64()
	oldKey := insert(t, pool, row{kind: 30622, created: now - 2000, d: &v})
	head := insert(t, pool, row{kind: 30622, created: now - 1000, d: &v})
	onlyW := insert(t, pool, row{kind: 30622, created: now - 1000, d: &w})
	headX := insert(t, pool, row{kind: 30622, created: now - 1000, d: &x})
	newerX := insert(t, pool, row{kind: 30622, created: now - 500, d: &x})
	for viewer, ev := range map[string]string{v: head, x: headX} {
		if _, err := pool.Exec(context.Background(), `INSERT INTO buzz.visibility_state (viewer, target_generation, published_generation, published_event)
			VALUES ($1, 1, 1, $2)`, viewer, ev); err != nil {
			t.Fatal(err)
		}
	}
	rule(t, pool, `INSERT INTO buzz.retention (name, kinds, max_age) VALUES ('snapshots', '{30622}', '1 minute')`)

	mustLead(t, u)
	if stored(t, pool, oldKey) {
		t.Error("a superseded snapshot (older relay key) is still stored")
	}
	if !stored(t, pool, head) {
		t.Error("the viewer's current 30622 head was purged")
	}
	if !stored(t, pool, onlyW) {
		t.Error("the newest 30622 of a viewer without visibility_state was purged")
	}
	if !stored(t, pool, headX) || !stored(t, pool, newerX) {
		t.Errorf("viewer with a newer snapshot than its published head: head stored=%v, newer stored=%v; want both",
			stored(t, pool, headX), stored(t, pool, newerX))
	}
}

// keep_newest keeps each author's N newest events of the rule's kinds (whatever their age) and
// removes the older ones past max_age; other kinds are untouched.
func TestUpkeepKeepNewestPerAuthor(t *testing.T) {
	_, pool, u := setup(t)
	now := time.Now().Unix()
	a, b := hex64(), hex64()
	var aOld []string
	for i := 0; i < 5; i++ {
		aOld = append(aOld, insert(t, pool, row{kind: 1, pubkey: a, created: now - 1000 + int64(i)}))
	}
	aNew := insert(t, pool, row{kind: 1, pubkey: a, created: now})
	aOther := insert(t, pool, row{kind: 7, pubkey: a, created: now - 5000})
	bOld := []string{insert(t, pool, row{kind: 1, pubkey: b, created: now - 3000}), insert(t, pool, row{kind: 1, pubkey: b, created: now - 2000})}
	rule(t, pool, `INSERT INTO buzz.retention (name, kinds, max_age, keep_newest) VALUES ('notes', '{1}', '1 minute', 3)`)
	// upkeep_status counts with a window what the purge finds row by row: the two must agree.
	if w := testenv.MustInt(t, pool, `SELECT waiting::int FROM buzz.upkeep_status() WHERE rule = 'retention:notes'`); w != 3 {
		t.Errorf("upkeep_status waiting %d before the pass, want 3", w)
	}

	mustLead(t, u)
	want := map[string]bool{aOld[0]: false, aOld[1]: false, aOld[2]: false, aOld[3]: true, aOld[4]: true,
		aNew: true, aOther: true, bOld[0]: true, bOld[1]: true}
	for id, keep := range want {
		if got := stored(t, pool, id); got != keep {
			t.Errorf("event %s stored=%v, want %v", id[:8], got, keep)
		}
	}
}

// Settled reminder rows older than the keep (7 days) go; armed and claimed rows stay whatever
// their timestamps say, and so does a recent confirmation and a confirmed version that could be
// stored (and armed) again.
func TestUpkeepRemindersSettledOnly(t *testing.T) {
	_, pool, u := setup(t)
	now := time.Now().Unix()
	pk := hex64()
	old := time.Now().Add(-8 * 24 * time.Hour)
	recent := time.Now().Add(-24 * time.Hour)
	add := func(state, d string, confirmed, cancelled *time.Time, lease *time.Time) string {
		id := hex64()
		if _, err := pool.Exec(context.Background(), `INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, state, confirmed_at, cancelled_at, lease_until, stamp)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1)`, id, pk, d, now-900000, now-800000, state, confirmed, cancelled, lease); err != nil {
			t.Fatalf("insert %s reminder: %v", state, err)
		}
		return id
	}
	// Timestamps an armed or claimed row should not carry (a hand edit, a re-armed version): the
	// state alone must keep them.
	armed := add("armed", "r1", nil, &old, nil)
	claimed := add("claimed", "r2", &old, nil, ptr(time.Now().Add(time.Minute)))
	cancelled := add("cancelled", "r3", nil, &old, nil)
	// A version still stored: publishing it again is a duplicate, so its row may go.
	storeVersion := func(id, d string) {
		if _, err := pool.Exec(context.Background(), `INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag)
			VALUES ($1, $2, $3, 30300, '[]'::jsonb, '', repeat('0', 128), $4)`, id, pk, now-900000, d); err != nil {
			t.Fatal(err)
		}
	}
	confirmedStored := add("confirmed", "r4", &old, nil, nil)
	storeVersion(confirmedStored, "r4")
	confirmedRecent := add("confirmed", "r5", &recent, nil, nil)
	storeVersion(confirmedRecent, "r5")
	confirmedLoose := add("confirmed", "r6", &old, nil, nil) // not stored, no tombstone: could come back

	mustLead(t, u)
	want := map[string]bool{armed: true, claimed: true, cancelled: false, confirmedStored: false,
		confirmedRecent: true, confirmedLoose: true}
	names := map[string]string{armed: "armed", claimed: "claimed", cancelled: "old cancelled", confirmedStored: "old confirmed (stored)",
		confirmedRecent: "recently confirmed", confirmedLoose: "old confirmed whose version could be stored again"}
	for id, keep := range want {
		got := testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.reminders WHERE id = $1`, id) == 1
		if got != keep {
			t.Errorf("%s reminder row kept=%v, want %v", names[id], got, keep)
		}
	}
}
