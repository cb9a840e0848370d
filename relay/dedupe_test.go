package relay

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/hooks"
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

// sentLive delivers ev (stored by transaction xid) as the fan-out would, and checks that c's
// subscription sub gets it live.
func sentLive(t *testing.T, tr *testRelay, c *client, sub string, ev *nostr.Event, xid uint32) {
	t.Helper()
	tr.s.DeliverEvent(storedDelivery(ev, xid))
	if got := c.nextEvent(sub); got.ID != ev.ID {
		t.Fatalf("live event %s on %s, want %s", got.ID, sub, ev.ID)
	}
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
		tr.s.DeliverEvent(storedDelivery(&evs[i], xid))
	}
	syncNone(t, c, "big")

	later, laterXid := storeRows(t, tr, pk, 1)
	sentLive(t, tr, c, "big", &later[0], laterXid)
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
		tr.s.DeliverEvent(storedDelivery(&evs[i], xid))
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
	tr.s.DeliverEvent(storedDelivery(&seen[0], seenXid))

	tx, pending, xid := openPendingRow(t, tr, pk)
	tr.s.DeliverEvent(storedDelivery(&pending, xid))
	_, stranger := testenv.NewKey()
	private := nostr.Event{ID: randHex64(), PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}}
	tr.s.DeliverEvent(evt.Delivery{Event: &private, Scope: evt.Scope{Kind: evt.ScopeP, P: stranger}, Xid: xid})

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
	tr.s.DeliverEvent(storedDelivery(&pending, xid)) // resent after a stream break
	syncNone(t, c, "s")
}

// subSnapshot returns the snapshot subscription id of tr's only connection holds (nil if none).
func subSnapshot(tr *testRelay, id string) *mvccSnapshot {
	for _, sc := range tr.s.snapshotConns() {
		sc.mu.Lock()
		sub := sc.subs[id]
		sc.mu.Unlock()
		if sub != nil {
			sub.mu.Lock()
			defer sub.mu.Unlock()
			return sub.snap
		}
	}
	return nil
}

// A subscription stops using its query's snapshot at the first delivery committed past the
// snapshot's WAL position: a transaction id 2^31 or more past the snapshot (a subscription open
// for days) would otherwise read as one the snapshot saw, and every event be skipped.
func TestSubscriptionDropsItsSnapshotPastItsWALPosition(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	storeRows(t, tr, pk, 1)
	c := tr.dial(t)
	c.req("long", nostr.Filter{Authors: []string{pk}})
	snap := subSnapshot(tr, "long")
	if snap == nil || snap.walPos == 0 {
		t.Fatalf("subscription snapshot %+v, want one with its WAL position", snap)
	}
	far := uint32(snap.xmax) + 1<<31 + 10 // the same low bits as a transaction 2^31 before
	if !snap.sees(far) {
		t.Fatal("test premise: the snapshot misreads an xid 2^31 ahead as seen")
	}
	later, _ := storeRows(t, tr, pk, 1)
	tr.s.DeliverEvent(evt.Delivery{Event: &later[0], Scope: evt.Scope{Kind: evt.ScopePublic}, Xid: far, CommitLSN: snap.walPos + 1})
	if got := c.nextEvent("long"); got.ID != later[0].ID {
		t.Fatalf("live event %s, want %s", got.ID, later[0].ID)
	}
	if subSnapshot(tr, "long") != nil {
		t.Fatal("the subscription still holds its snapshot")
	}
}

// What was delivered before a REQ registered is taken as it registers: however long its query
// then waits, and however many events pass meanwhile (here the whole kept window), an event its
// snapshot misses is still sent.
func TestReplayKeepsWhatWasDeliveredAtRegistration(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	_, pending, xid := openPendingRow(t, tr, pk)
	tr.s.DeliverEvent(storedDelivery(&pending, xid))

	reached, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	defer hooks.Set("relay.req.registered", func(context.Context) {
		once.Do(func() { close(reached); <-release })
	})()
	c := tr.dial(t)
	c.sendJSON("REQ", "s", nostr.Filter{Authors: []string{pk}})
	<-reached
	_, other := testenv.NewKey()
	for i := 0; i < recentMaxEntries+10; i++ { // pushes the pending event out of the kept window
		ev := nostr.Event{ID: randHex64(), PubKey: other, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}}
		tr.s.DeliverEvent(storedDelivery(&ev, xid+1))
	}
	close(release)
	got, closed := c.collect("s")
	if closed != "" || len(got) != 1 || got[0].ID != pending.ID {
		t.Fatalf("REQ answered %d events (CLOSED %q), want only the one its snapshot missed", len(got), closed)
	}
}

// A replayed event of a DM whose member set cannot be read closes the subscription with an error
// (a gated event dropped silently would be a gap the client never learns of).
func TestReplayWithoutMembersClosesTheSubscription(t *testing.T) {
	_, a, b := dmEventWhoseLookupFails(t)
	if _, closed := b.c.reqOrClosed("s", nostr.Filter{Authors: []string{a.pk}}); closed != "error: could not check channel membership, try again" {
		t.Fatalf("CLOSED %q, want the membership error", closed)
	}
}

// dmEventWhoseLookupFails: a delivered DM message by a to b whose commit no query can see yet,
// and a hook that takes the client's whole share of the query pool (1) as soon as a REQ's query
// is done, so a member lookup after it times out (200 ms).
func dmEventWhoseLookupFails(t *testing.T) (tr *testRelay, a, b party) {
	t.Helper()
	tr = startRelay(t, func(c *Config) { c.MaxQueriesPerIP = 1 })
	tr.s.memberWait = 200 * time.Millisecond
	ctx := context.Background()
	a = newParty(t, tr, true)
	b = newParty(t, tr, true)
	ch := openDM(t, a, b.pk)
	tx, err := tr.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(ctx) })
	pending, xid := pendingRow(t, tx, a.pk)
	tr.s.DeliverEvent(evt.Delivery{Event: &pending, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}, Xid: xid})
	var once sync.Once
	var taken atomic.Bool // set on a connection's goroutine, read by the cleanup
	t.Cleanup(hooks.Set("relay.req.queried", func(context.Context) {
		once.Do(func() { taken.Store(tr.s.ipQueries.acquire(ctx, "127.0.0.1")) })
	}))
	t.Cleanup(func() {
		if taken.Load() {
			tr.s.ipQueries.release("127.0.0.1")
		}
	})
	return tr, a, b
}

// openPendingRow begins a transaction on tr's pool (rolled back at cleanup unless the test commits
// it) and inserts a pendingRow of pk in it.
func openPendingRow(t *testing.T, tr *testRelay, pk string) (pgx.Tx, nostr.Event, uint32) {
	t.Helper()
	ctx := context.Background()
	tx, err := tr.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	ev, xid := pendingRow(t, tx, pk)
	return tx, ev, xid
}

// pendingRow inserts a public kind-1 row of pk in tx (not committed: other sessions do not see
// it) and returns it with tx's id.
func pendingRow(t *testing.T, tx pgx.Tx, pk string) (nostr.Event, uint32) {
	t.Helper()
	var id string
	var xid int64
	if err := tx.QueryRow(context.Background(), `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		VALUES (md5($1 || clock_timestamp()) || md5($1), $1, $2, 1, '[]', 'not visible yet', repeat('0', 128))
		RETURNING id, pg_current_xact_id()::text::bigint`, pk, int64(nostr.Now())).Scan(&id, &xid); err != nil {
		t.Fatal(err)
	}
	return nostr.Event{ID: id, PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}, Content: "not visible yet"}, uint32(xid)
}

// A connection an error left inside the REQ transaction goes back to the pool usable (the pool
// would otherwise drop it and open another, a backend start per failed query).
func TestAbandonTxReturnsTheConnection(t *testing.T) {
	tr := startRelay(t, nil)
	ctx := context.Background()
	pc, err := tr.s.query.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid := pc.Conn().PgConn().PID()
	released := false
	defer func() { // a failing check must not leave the pool's Close waiting for it
		if !released {
			pc.Release()
		}
	}()
	b := &pgx.Batch{}
	b.Queue(`BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY`)
	b.Queue(`SELECT 1 / 0`)
	b.Queue(`COMMIT`)
	if err := pc.SendBatch(ctx, b).Close(); err == nil {
		t.Fatal("division by zero did not fail")
	}
	if st := pc.Conn().PgConn().TxStatus(); st != 'E' {
		t.Fatalf("transaction status %q, want E (failed, open)", st)
	}
	abandonTx(pc)
	if st := pc.Conn().PgConn().TxStatus(); st != 'I' {
		t.Fatalf("after abandonTx: transaction status %q, want I", st)
	}
	pc.Release()
	released = true
	idle := tr.s.query.AcquireAllIdle(ctx)
	defer func() {
		for _, c := range idle {
			c.Release()
		}
	}()
	for _, c := range idle {
		if c.Conn().PgConn().PID() == pid {
			return
		}
	}
	t.Fatalf("backend %d was not returned to the pool", pid)
}

// A filter with limit 0 had no initial query, so the snapshot says nothing for it: an event
// committed while the REQ waited for its query, seen by the other filter's snapshot, still
// reaches it live.
func TestLimitZeroFilterIsLiveWhateverTheSnapshotSaw(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	reached, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	defer hooks.Set("relay.req.registered", func(context.Context) {
		once.Do(func() { close(reached); <-release })
	})()
	c := tr.dial(t)
	c.sendJSON("REQ", "s", nostr.Filter{Kinds: []int{7}, Authors: []string{pk}, Limit: 10},
		nostr.Filter{Kinds: []int{1}, Authors: []string{pk}, LimitZero: true})
	<-reached
	evs, xid := storeRows(t, tr, pk, 1) // committed after registration, before the query
	close(release)
	if got, closed := c.collect("s"); len(got) != 0 || closed != "" {
		t.Fatalf("initial answer %d events, CLOSED %q; want none (limit 0 for kind 1)", len(got), closed)
	}
	if subSnapshot(tr, "s") == nil || !subSnapshot(tr, "s").sees(xid) {
		t.Fatal("test premise: the query's snapshot saw the event")
	}
	sentLive(t, tr, c, "s", &evs[0], xid)
}

// A stream reset (a new slot, after a failover say) drops every subscription's snapshot: WAL
// positions and transaction ids from before it may be reused.
func TestStreamResetDropsSnapshots(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, 1)
	c := tr.dial(t)
	c.req("s", nostr.Filter{Authors: []string{pk}})
	if subSnapshot(tr, "s") == nil {
		t.Fatal("no snapshot after the query")
	}
	tr.s.StreamRestarted()
	if subSnapshot(tr, "s") != nil {
		t.Fatal("the snapshot outlived a stream reset")
	}
	// The same transaction id, from the new timeline, is new.
	sentLive(t, tr, c, "s", &evs[0], xid)
}

// A connection that has not authenticated is nobody's member: a replayed DM event is skipped
// without a member lookup (which here could not get the client's query share and would close the
// subscription).
func TestReplayOfADMEventNeedsNoLookupWithoutAuth(t *testing.T) {
	tr, a, _ := dmEventWhoseLookupFails(t)
	anon := tr.dial(t)
	if got, closed := anon.reqOrClosed("s", nostr.Filter{Authors: []string{a.pk}}); len(got) != 0 || closed != "" {
		t.Fatalf("anonymous REQ: %d events, CLOSED %q; want EOSE and nothing", len(got), closed)
	}
}

// An event delivered live while the REQ's query runs is not sent again as a row, even when more
// live events than the seen window holds (4,096) come before the rows are sent.
func TestLiveDuringQueryNotResentAfterAFlood(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, 1)
	reached, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	defer hooks.Set("relay.req.queried", func(context.Context) {
		once.Do(func() { close(reached); <-release })
	})()
	c := tr.dial(t)
	c.sendJSON("REQ", "s", nostr.Filter{Authors: []string{pk}})
	<-reached // the query has read the row; the rows are not sent yet
	tr.s.DeliverEvent(storedDelivery(&evs[0], xid))
	flood := seenPerSub + 100
	for i := 0; i < flood; i++ {
		ev := nostr.Event{ID: randHex64(), PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}}
		tr.s.DeliverEvent(storedDelivery(&ev, xid+1))
	}
	close(release)
	got, closed := c.collect("s")
	n := 0
	for _, e := range got {
		if e.ID == evs[0].ID {
			n++
		}
	}
	if closed != "" || n != 1 || len(got) != flood+1 {
		t.Fatalf("CLOSED %q; the stored event sent %d times, %d events in all; want it once among %d", closed, n, len(got), flood+1)
	}
}

// An event kept for replay (delivered before the REQ registered, not visible to its query) that
// also comes live while the query runs is sent once, even when more live events than seen holds
// follow it before the replay: sentLive, kept until the replay is out, still has it (before, it
// was dropped once the rows were out, and the replay sent the event a second time).
func TestReplayAfterAFloodSendsTheEventOnce(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	_, pending, xid := openPendingRow(t, tr, pk)
	tr.s.DeliverEvent(storedDelivery(&pending, xid))

	var once sync.Once
	defer hooks.Set("relay.req.queried", func(context.Context) {
		once.Do(func() {
			tr.s.DeliverEvent(storedDelivery(&pending, xid)) // resent by the stream: goes out live
			for i := 0; i < seenPerSub+100; i++ {            // and then pushes it out of seen
				ev := nostr.Event{ID: randHex64(), PubKey: pk, CreatedAt: nostr.Now(), Kind: 1, Tags: nostr.Tags{}}
				tr.s.DeliverEvent(storedDelivery(&ev, xid+1))
			}
		})
	})()
	c := tr.dial(t)
	got, closed := c.reqOrClosed("s", nostr.Filter{Authors: []string{pk}})
	if closed != "" {
		t.Fatalf("REQ closed: %s", closed)
	}
	n := 0
	for _, e := range got {
		if e.ID == pending.ID {
			n++
		}
	}
	if n != 1 {
		t.Fatalf("the pending event was sent %d times before EOSE (of %d events), want once", n, len(got))
	}
}
