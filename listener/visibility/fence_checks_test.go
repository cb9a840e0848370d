package visibility

// Guards of the snapshot path that had no test of their own: the one-snapshot read of
// buzz.visibility_source, each created_at check of buzz.publish_visibility_snapshot (I4), the
// outbox clean-up of 'published' and 'stale', and the read scope of the stored snapshot (I7).
// Both functions live in sql/0003_visibility.up.sql.

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// publishedHiddenViewer is a viewer with one hidden DM x whose snapshot of generation g is
// published.
func (e *env) publishedHiddenViewer() (viewer, x string, g int64) {
	e.t.Helper()
	viewer, x = e.hiddenViewer()
	g = e.gens(viewer).target
	out, err := PublishSigned(context.Background(), e.pool, viewer, g, signedSnapshot(e.t, e.sk, viewer, []string{x}, e.dbNow()))
	if err != nil || out != OutcomePublished {
		e.t.Fatalf("first snapshot: %q %v", out, err)
	}
	return viewer, x, g
}

// outboxGeneration is the generation of viewer's outbox row (ok = false: no row).
func (e *env) outboxGeneration(viewer string) (gen int64, ok bool) {
	e.t.Helper()
	err := e.pool.QueryRow(context.Background(),
		`SELECT generation FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&gen)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return gen, true
}

// publishedCreatedAt is the created_at the viewer's state row records as published.
func (e *env) publishedCreatedAt(viewer string) *int64 {
	e.t.Helper()
	var c *int64
	if err := e.pool.QueryRow(context.Background(),
		`SELECT published_created_at FROM buzz.visibility_state WHERE viewer = $1`, viewer).Scan(&c); err != nil {
		e.t.Fatal(err)
	}
	return c
}

// docs/design.md: "visibility_source reads generation and hidden set from ONE snapshot": a reader that
// read them in two statements under READ COMMITTED could pair generation g+1 with the hidden set
// of g (or g with the set of g+1) and publish a wrong state for good.
//
// Interleaving: writer X hides a second DM (members row and state row changed, uncommitted) and
// takes ACCESS EXCLUSIVE on one of the two tables; reader R calls visibility_source through the Go
// readers and is observed blocked on that lock (or done); X commits. A plain SELECT waits only on a
// table lock, and a statement takes its snapshot after its locks: a two-statement reader has read
// the unlocked table before X committed and reads the locked one after, so its result is mixed.
// Locking members catches "generation first"; locking visibility_state catches "hidden set
// first". One statement (today's function) locks both tables before its snapshot: consistent.
func TestVisibilitySourceReadsOneSnapshot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	readers := []struct {
		name string
		read func(ctx context.Context, q Querier, viewer string) (Source, error)
	}{
		{"ReadSource", ReadSource},
		{"ReadSources", func(ctx context.Context, q Querier, viewer string) (Source, error) {
			m, err := ReadSources(ctx, q, []string{viewer})
			return m[viewer], err
		}},
	}
	for _, table := range []string{"buzz.members", "buzz.visibility_state"} {
		for _, rd := range readers {
			t.Run(table+"/"+rd.name, func(t *testing.T) {
				viewer, x, y := e.viewerWithTwoDMs()
				e.hide(viewer, x)
				g, setG := e.gens(viewer).target, e.hiddenSet(viewer) // g = {x}

				w := testenv.NewSession(t, e.url, "source-writer")
				w.Begin()
				if _, err := w.Tx.Exec(ctx, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, y); err != nil {
					t.Fatal(err)
				}
				if _, err := w.Tx.Exec(ctx, `LOCK TABLE `+table+` IN ACCESS EXCLUSIVE MODE`); err != nil {
					t.Fatal(err)
				}

				r := testenv.NewSession(t, e.url, "source-reader")
				var src Source
				var rerr error
				done := testenv.Async(func() { src, rerr = rd.read(ctx, r.Conn, viewer) })
				// visibility_source reads both tables, so the reader always waits for the lock:
				// had it finished first, the interleaving this test is about did not happen.
				if !testenv.WaitBlockedOrDone(t, e.pool, r.PID, done) {
					w.Rollback()
					t.Fatalf("the reader finished without waiting for the lock on %s: the interleaving was not exercised", table)
				}
				w.Commit()
				<-done
				if rerr != nil {
					t.Fatal(rerr)
				}
				setG1 := e.hiddenSet(viewer) // g+1 = {x, y}
				if g1 := e.gens(viewer).target; g1 != g+1 || len(setG1) != 2 {
					t.Fatalf("setup: after the writer generation %d hidden %v, want %d with two", g1, setG1, g+1)
				}
				t.Logf("read generation %d hidden %d", src.Generation, len(src.Hidden))
				switch {
				case src.Generation == g && slices.Equal(src.Hidden, setG):
				case src.Generation == g+1 && slices.Equal(src.Hidden, setG1):
				default:
					t.Fatalf("visibility_source mixed two states: generation %d with hidden %v; want %d with %v or %d with %v",
						src.Generation, src.Hidden, g, setG, g+1, setG1)
				}
			})
		}
	}
}

// I4, the fence's own created_at check (publish_visibility_snapshot's fence UPDATE:
// published_created_at < e_created). An operator deleted the viewer's head 30622 row, so the
// head check (created_at above every stored 30622) has nothing to compare with; only the state's
// recorded published_created_at still knows what clients may hold. A new generation's snapshot at
// that same created_at must come back 'retry' with nothing inserted.
func TestSnapshotCreatedAtFenceAfterHeadDeleted(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x, g := e.publishedHiddenViewer()
	recorded := e.publishedCreatedAt(viewer)
	if recorded == nil {
		t.Fatal("setup: no published_created_at recorded")
	}

	e.exec(`DELETE FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, viewer) // the operator
	e.unhide(viewer, x)                                                         // generation g+1, nothing hidden
	out, err := PublishSigned(ctx, e.pool, viewer, g+1, signedSnapshot(t, e.sk, viewer, nil, *recorded))
	if err != nil || out != OutcomeRetry {
		t.Fatalf("snapshot at the recorded created_at %d after the head was deleted: %q %v, want retry", *recorded, out, err)
	}
	if head, _ := e.head(viewer); head != nil {
		t.Fatalf("a snapshot was inserted: %s at %d", short(head.ID), head.CreatedAt)
	}
	if gp := e.gens(viewer); gp.published != g || gp.target != g+1 {
		t.Fatalf("generations %+v, want published %d target %d (nothing changed)", gp, g, g+1)
	}
}

// I4, the head check (publish_visibility_snapshot: e_created <= head_created → 'retry'). The head
// exists but the state row no longer records it: the operator reset the viewer (DELETE FROM
// buzz.visibility_state; the state restarts the row above the retired generation with
// published_created_at NULL), so the fence's created_at condition passes. A snapshot of the new
// generation at the head's created_at must come back 'retry' and leave the head alone.
func TestSnapshotCreatedAtHeadCheckAfterStateReset(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x, _ := e.publishedHiddenViewer()
	head, _ := e.head(viewer)

	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer) // the operator's reset
	e.unhide(viewer, x)                                                   // restarted row: pending, nothing hidden
	gp := e.gens(viewer)
	if gp.target <= gp.published || e.publishedCreatedAt(viewer) != nil {
		t.Fatalf("setup: restarted state %+v should be pending with no published_created_at", gp)
	}
	// Different content (nothing hidden), so a wrongly accepted snapshot gets a different id.
	out, err := PublishSigned(ctx, e.pool, viewer, gp.target, signedSnapshot(t, e.sk, viewer, nil, int64(head.CreatedAt)))
	if err != nil || out != OutcomeRetry {
		t.Fatalf("snapshot at the head's created_at %d: %q %v, want retry", head.CreatedAt, out, err)
	}
	now, hs := e.head(viewer)
	if now == nil || now.ID != head.ID || !slices.Equal(hs, []string{x}) {
		t.Fatalf("head changed: %v hiding %v, want %s hiding [%s]", now, hs, short(head.ID), x)
	}
	if after := e.gens(viewer); after != gp {
		t.Fatalf("generations moved: %+v -> %+v", gp, after)
	}
}

// 'published' clears the outbox row only up to its own generation (DELETE ... generation <= g).
// Publisher A read generation g and is held at HookBeforeFence; the viewer changes again (outbox
// row raised to g+1); A publishes g. The g+1 row must survive (nothing else would publish g+1 until
// a sweep), and the next publication, of g+1, clears it.
func TestSnapshotPublishKeepsNewerOutboxRow(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x, y := e.viewerWithTwoDMs()
	e.hide(viewer, x)
	g := e.gens(viewer).target

	a, gateA, resA := e.pausedPublisher("A", viewer) // A holds g = {x}

	e.hide(viewer, y) // g+1 = {x, y}
	if og, ok := e.outboxGeneration(viewer); !ok || og != g+1 {
		t.Fatalf("setup: outbox row %d (present %v), want %d", og, ok, g+1)
	}
	gateA.Open()
	if r := <-resA; r.err != nil || r.out != OutcomePublished {
		t.Fatalf("A publishing g: %q %v, want published", r.out, r.err)
	}
	if gp := e.gens(viewer); gp.published != g || gp.target != g+1 {
		t.Fatalf("generations %+v, want published %d target %d", gp, g, g+1)
	}
	if og, ok := e.outboxGeneration(viewer); !ok || og != g+1 {
		t.Fatalf("after publishing %d the outbox row is %d (present %v), want %d kept", g, og, ok, g+1)
	}

	if o, err := a.PublishViewer(ctx, viewer); err != nil || o != OutcomePublished {
		t.Fatalf("publishing g+1: %q %v", o, err)
	}
	if og, ok := e.outboxGeneration(viewer); ok {
		t.Fatalf("outbox row %d left after publishing %d", og, g+1)
	}
	e.assertConverged(viewer)
}

// 'stale' clears an outbox row already covered by the published generation, so nothing loops:
// such a row (generation = published) appears when a sweep re-creates it from a state it read
// just before the publication committed (sql/0003_visibility, sweep_visibility's comment). Without the DELETE
// in the 'stale' branch every claimer of that row gets 'stale' and leaves it for the next one. A
// row with a newer generation is kept by the same branch.
func TestSnapshotStaleClearsCoveredOutboxRow(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x, y := e.viewerWithTwoDMs()
	e.hide(viewer, x)
	src, err := ReadSource(ctx, e.pool, viewer)
	if err != nil {
		t.Fatal(err)
	}
	created, _ := src.CreatedAt()
	ev := signedSnapshot(t, e.sk, viewer, src.Hidden, created)
	g := src.Generation
	if out, err := PublishSigned(ctx, e.pool, viewer, g, ev); err != nil || out != OutcomePublished {
		t.Fatalf("publish g: %q %v", out, err)
	}

	e.exec(`INSERT INTO buzz.visibility_outbox (viewer, generation) VALUES ($1, $2)`, viewer, g) // covered
	if out, err := PublishSigned(ctx, e.pool, viewer, g, ev); err != nil || out != OutcomeStale {
		t.Fatalf("publishing g again: %q %v, want stale", out, err)
	}
	if og, ok := e.outboxGeneration(viewer); ok {
		t.Fatalf("'stale' left the covered outbox row (generation %d, published %d)", og, g)
	}

	e.hide(viewer, y) // g+1: a row with work still to do
	if out, err := PublishSigned(ctx, e.pool, viewer, g, ev); err != nil || out != OutcomeStale {
		t.Fatalf("publishing g after g+1 arrived: %q %v, want stale", out, err)
	}
	if og, ok := e.outboxGeneration(viewer); !ok || og != g+1 {
		t.Fatalf("'stale' at %d removed the newer outbox row: %d (present %v), want %d", g, og, ok, g+1)
	}
}

// I7 for the snapshots the publisher writes: the stored 30622 row carries the read gate scope
// 'p' with scope_p = viewer, which REQ and COUNT (and fan-out) filter on; with scope '*' every
// connection could read who hides which DM. Both publication paths: PublishViewer (single) and
// publishMany (the batch the worker uses).
func TestSnapshotStoredWithViewerScope(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	single, batch := e.pendingViewer(), e.pendingViewer()
	if o, err := e.publisher("A", nil).PublishViewer(ctx, single); err != nil || o != OutcomePublished {
		t.Fatalf("PublishViewer: %q %v", o, err)
	}
	if outs, err := publishMany(ctx, e.pool, []signedItem{e.signedItemFor(batch)}); err != nil || outs[0] != OutcomePublished {
		t.Fatalf("publishMany: %v %v", outs, err)
	}
	for _, v := range []string{single, batch} {
		var scope, scopeP string
		if err := e.pool.QueryRow(ctx, `SELECT scope::text, coalesce(scope_p, '') FROM buzz.events
			WHERE kind = 30622 AND d_tag = $1`, v).Scan(&scope, &scopeP); err != nil {
			t.Fatal(err)
		}
		if scope != "p" || scopeP != v {
			t.Fatalf("snapshot of %s stored with scope %q scope_p %q, want 'p' and the viewer", short(v), scope, short(scopeP))
		}
	}
}
