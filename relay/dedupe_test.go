package relay

import (
	"context"
	"slices"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// storeRows inserts n public kind-1 rows of pk straight into buzz.events in one transaction (the
// relay serves rows as stored) and returns them newest first, with that transaction's id.
func storeRows(t *testing.T, tr *testRelay, pk string, n int) ([]nostr.Event, uint32) {
	t.Helper()
	base := int64(nostr.Now()) - int64(n) - 10
	rows, err := tr.pool.Query(context.Background(), `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		SELECT md5($1 || i || clock_timestamp()) || md5(i || $1), $1, $2 + i, 1, '[]', 'row ' || i, repeat('0', 128)
		  FROM generate_series(1, $3) i
		RETURNING id, created_at, xmin::text::bigint`, pk, base, n)
	if err != nil {
		t.Fatal(err)
	}
	var out []nostr.Event
	var xid int64
	for rows.Next() {
		var ev nostr.Event
		var at int64
		if err := rows.Scan(&ev.ID, &at, &xid); err != nil {
			t.Fatal(err)
		}
		ev.PubKey, ev.CreatedAt, ev.Kind, ev.Tags = pk, nostr.Timestamp(at), 1, nostr.Tags{}
		out = append([]nostr.Event{ev}, out...)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out, uint32(xid)
}

// storedDelivery is what the fan-out hands over for a stored public event of transaction xid.
func storedDelivery(ev *nostr.Event, xid uint32) evt.Delivery {
	return evt.Delivery{Event: ev, Scope: evt.Scope{Kind: evt.ScopePublic}, Xid: xid}
}

// Sent at most once per subscription, however large the answer: every row of it arrives live
// afterwards (replication catching up on more rows than a window of remembered ids holds) and
// none is sent again. An event committed after the query is.
func TestAnsweredEventsAreNotSentLive(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, seenPerSub+200)
	c := tr.dial(t)
	if got := c.req("big", nostr.Filter{Authors: []string{pk}, Limit: len(evs)}); len(got) != len(evs) {
		t.Fatalf("initial answer has %d rows, want %d", len(got), len(evs))
	}
	for i := range evs {
		tr.s.Deliver(storedDelivery(&evs[i], xid))
	}
	syncNone(t, c, "big")

	later, laterXid := storeRows(t, tr, pk, 1)
	tr.s.Deliver(storedDelivery(&later[0], laterXid))
	if got := c.nextEvent("big"); got.ID != later[0].ID {
		t.Fatalf("live event %s, want the one committed after the query %s", got.ID, later[0].ID)
	}
}

// Events the query passed over are not sent live either: those beyond its limit (older than the
// answer) and one deleted before it ran. Two filters, so the rows answered are more than one
// filter's limit.
func TestPassedOverEventsAreNotSentLive(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, 30)
	gone := evs[1]
	if _, err := tr.pool.Exec(context.Background(), `DELETE FROM buzz.events WHERE id = $1`, gone.ID); err != nil {
		t.Fatal(err)
	}
	c := tr.dial(t)
	got := c.req("cut", nostr.Filter{Authors: []string{pk}, Limit: 5},
		nostr.Filter{Authors: []string{pk}, Until: &evs[10].CreatedAt, Limit: 5})
	if len(got) != 10 || slices.ContainsFunc(got, func(e nostr.Event) bool { return e.ID == gone.ID }) {
		t.Fatalf("answer has %d rows (want 10, without the deleted one)", len(got))
	}
	for i := range evs {
		tr.s.Deliver(storedDelivery(&evs[i], xid))
	}
	syncNone(t, c, "cut")
}

// An event can reach Deliver before its commit is visible to other sessions (PostgreSQL writes
// the commit record, which logical decoding reads, first). A REQ registered right then misses it
// in its query, and gets it from what Deliver kept, before EOSE; an event its query did see is not
// sent twice, and one the connection may not read is not sent at all. The open transaction here
// stands for that moment: its row is not visible, its delivery already happened.
func TestEventDeliveredBeforeItsCommitIsVisibleIsReplayed(t *testing.T) {
	tr := startRelay(t, nil)
	ctx := context.Background()
	_, pk := testenv.NewKey()
	seen, seenXid := storeRows(t, tr, pk, 1)
	tr.s.Deliver(storedDelivery(&seen[0], seenXid))

	tx, err := tr.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var id string
	var xid int64
	if err := tx.QueryRow(ctx, `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		VALUES (md5($1 || clock_timestamp()) || md5($1), $1, $2, 1, '[]', 'not visible yet', repeat('0', 128))
		RETURNING id, pg_current_xact_id()::text::bigint`, pk, int64(nostr.Now())).Scan(&id, &xid); err != nil {
		t.Fatal(err)
	}
	pending := nostr.Event{ID: id, PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}, Content: "not visible yet"}
	tr.s.Deliver(storedDelivery(&pending, uint32(xid)))
	_, stranger := testenv.NewKey()
	private := nostr.Event{ID: randHex64(), PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}}
	tr.s.Deliver(evt.Delivery{Event: &private, Scope: evt.Scope{Kind: evt.ScopeP, P: stranger}, Xid: uint32(xid)})

	c := tr.dial(t)
	got := c.req("s", nostr.Filter{Authors: []string{pk}})
	var ids []string
	for _, e := range got {
		ids = append(ids, e.ID)
	}
	want := []string{seen[0].ID, pending.ID}
	slices.Sort(ids)
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Fatalf("REQ answered %v, want the committed event and the one not visible yet %v, each once", ids, want)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	tr.s.Deliver(storedDelivery(&pending, uint32(xid))) // resent after a stream break
	syncNone(t, c, "s")
}
