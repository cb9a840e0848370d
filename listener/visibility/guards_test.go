package visibility

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// pendingViewer returns a new viewer with one hidden DM, so its snapshot is owed.
func (e *env) pendingViewer() string {
	e.t.Helper()
	viewer, _ := e.hiddenViewer()
	if g := e.gens(viewer); g.target <= g.published {
		e.t.Fatalf("viewer %s not pending: %+v", short(viewer), g)
	}
	return viewer
}

// signedItemFor reads viewer's source and signs its snapshot as the publisher would.
func (e *env) signedItemFor(viewer string) signedItem {
	e.t.Helper()
	src, err := ReadSource(context.Background(), e.pool, viewer)
	if err != nil {
		e.t.Fatal(err)
	}
	createdAt, _ := src.CreatedAt()
	ev := signedSnapshot(e.t, e.sk, viewer, src.Hidden, createdAt)
	body, _ := ev.MarshalJSON()
	return signedItem{viewer: viewer, generation: src.Generation, ev: ev, body: string(body)}
}

// Go retries SQLSTATE 40001 around the publisher's publication calls (PublishSigned, and
// publishMany for the batch): a publication whose first attempt is rolled back with a
// serialization failure comes back 'published' from the retry. The control shows the provoked
// failure reaches a caller that does not retry.
func TestPublishRetriesSerializationFailure(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	// The first 30622 insert after each RESTART raises 40001; the sequence is not rolled back with
	// the failed transaction, so the retry passes.
	e.exec(`
		CREATE SEQUENCE public.snapshot_attempts;
		CREATE FUNCTION public.snapshot_fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF nextval('public.snapshot_attempts') = 1 THEN
		    RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = 'test: provoked on the first attempt';
		  END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER snapshot_fail_once BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.snapshot_fail_once();`)
	attempts := func() int64 {
		var n int64
		if err := e.pool.QueryRow(ctx, `SELECT last_value FROM public.snapshot_attempts`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	rearm := func() { e.exec(`ALTER SEQUENCE public.snapshot_attempts RESTART`) }

	t.Run("single", func(t *testing.T) {
		viewer := e.pendingViewer()
		it := e.signedItemFor(viewer)
		rearm()
		var out string
		err := e.pool.QueryRow(ctx, `SELECT buzz.publish_visibility_snapshot($1, $2, $3::jsonb)`,
			viewer, it.generation, it.body).Scan(&out)
		if db.SQLState(err) != "40001" {
			t.Fatalf("control without retry: %q, err %v, want SQLSTATE 40001", out, err)
		}
		rearm()
		out, err = PublishSigned(ctx, e.pool, viewer, it.generation, it.ev)
		if err != nil || out != OutcomePublished {
			t.Fatalf("PublishSigned with one serialization failure: %q, %v; want published on retry", out, err)
		}
		if n := attempts(); n != 2 {
			t.Fatalf("snapshot insert attempts %d, want 2", n)
		}
		e.assertConverged(viewer)
	})

	t.Run("batch", func(t *testing.T) {
		items := []signedItem{e.signedItemFor(e.pendingViewer()), e.signedItemFor(e.pendingViewer())}
		rearm()
		if _, err := e.pool.Exec(ctx, `SELECT * FROM buzz.publish_visibility_snapshots($1::text[], $2::bigint[], $3::jsonb[])`,
			[]string{items[0].viewer, items[1].viewer}, []int64{items[0].generation, items[1].generation},
			[]string{items[0].body, items[1].body}); db.SQLState(err) != "40001" {
			t.Fatalf("control without retry: err %v, want SQLSTATE 40001", err)
		}
		rearm()
		outs, err := publishMany(ctx, e.pool, items)
		if err != nil {
			t.Fatalf("publishMany with one serialization failure: %v; want published on retry", err)
		}
		for i, o := range outs {
			if o != OutcomePublished {
				t.Fatalf("batch outcome %d: %q, want published", i, o)
			}
		}
		if n := attempts(); n != 3 {
			t.Fatalf("snapshot insert attempts %d, want 3 (one failed, two in the retried batch)", n)
		}
		e.assertConverged(items[0].viewer)
		e.assertConverged(items[1].viewer)
	})
}

// A new generation resets backoff (bump_visibility): a viewer whose outbox row sits in an hour
// of backoff after failed publications, and then changes again, is published at once, not after
// the hour.
func TestSnapshotNewGenerationResetsBackoff(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x, y := e.viewerWithTwoDMs()

	e.exec(`CREATE FUNCTION public.fail_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: snapshot storage down'; END $$;
		CREATE TRIGGER fail_snapshots BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.fail_snapshots();`)
	p := e.publisher("A", func(c *Config) {
		c.BackoffBase = time.Hour
		c.BackoffMax = time.Hour
	})
	e.start(p)

	e.hide(viewer, x)
	testenv.WaitUntil(t, 20*time.Second, "the failed publication released into a long backoff", func() bool {
		var inBackoff bool
		_ = e.pool.QueryRow(ctx, `SELECT attempts >= 1 AND claim_id IS NULL AND available_at > now() + interval '30 minutes'
			FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&inBackoff)
		return inBackoff
	})
	if g := e.gens(viewer); g.published >= g.target {
		t.Fatalf("published while storage was down: %+v", g)
	}

	// Storage is back; the viewer changes again. The new generation must not wait out the hour.
	e.exec(`DROP TRIGGER fail_snapshots ON buzz.events`)
	e.hide(viewer, y)
	var attempts int
	var wait float64
	if err := e.pool.QueryRow(ctx, `SELECT attempts, extract(epoch FROM available_at - now())
		FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&attempts, &wait); err == nil && (attempts != 0 || wait > 1) {
		t.Errorf("after the bump the outbox row has attempts %d and is available in %.0fs, want 0 and now", attempts, wait)
	}
	e.waitConverged([]string{viewer}, 20*time.Second)
	if p.counters().Failed == 0 {
		t.Fatal("the publisher never failed: the backoff was not exercised")
	}
	e.assertAuditMonotonic()
}

// The publisher waits for the database clock when floor + 1 is more than 10 s ahead of it
// (snapshot.go, 'would run ahead of the database clock'): with the viewer's floor at db now + 12,
// the snapshot is published with created_at = floor + 1, never more than 10 s ahead of the
// database clock of the publishing transaction, and without any rejected ('retry') or failed
// publication on the way.
func TestSnapshotWaitsForDatabaseClock(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	// now() is the publishing transaction's start (the clock can only be later at the insert).
	e.exec(`
		CREATE TABLE public.snapshot_clock (created_at bigint, tx_now bigint, insert_now bigint);
		CREATE FUNCTION public.snapshot_clock_fn() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  INSERT INTO public.snapshot_clock VALUES (NEW.created_at, floor(extract(epoch FROM now()))::bigint, buzz.now_unix());
		  RETURN NULL;
		END $$;
		CREATE TRIGGER snapshot_clock AFTER INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.snapshot_clock_fn();`)
	viewer := e.pendingViewer()
	var floor int64
	if err := e.pool.QueryRow(ctx, `UPDATE buzz.visibility_state SET published_created_at = buzz.now_unix() + 12
		WHERE viewer = $1 RETURNING published_created_at`, viewer).Scan(&floor); err != nil {
		t.Fatal(err)
	}

	p := e.publisher("A", nil)
	e.start(p)
	e.waitConverged([]string{viewer}, 30*time.Second)

	rows, err := e.pool.Query(ctx, `SELECT created_at, tx_now, insert_now FROM public.snapshot_clock`)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	for rows.Next() {
		var created, txNow, insertNow int64
		if err := rows.Scan(&created, &txNow, &insertNow); err != nil {
			t.Fatal(err)
		}
		n++
		if created != floor+1 {
			t.Errorf("snapshot created_at %d, want floor + 1 = %d", created, floor+1)
		}
		if created-txNow > 10 {
			t.Errorf("snapshot created_at %d published when the database clock was %d: %d s ahead, more than 10",
				created, txNow, created-txNow)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if n != 1 {
		t.Fatalf("%d snapshots inserted, want 1", n)
	}
	if s := p.counters(); s.Retry != 0 || s.Failed != 0 {
		t.Fatalf("publisher stats %+v: a publication ran ahead of the clock and was refused instead of waiting", s)
	}
	if !strings.Contains(e.logs.String(), "would run ahead of the database clock") {
		t.Fatal("the publisher never waited for the clock")
	}
}

// The batch publication skips a viewer whose state row another transaction holds: 'busy', nothing
// changed, never waited for (sql/0003_visibility: FOR UPDATE SKIP LOCKED in publish_visibility_snapshots).
// The call returns while the lock is still held; once it is released the viewer converges.
func TestSnapshotBatchSkipsBusyViewer(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	free, busy := e.pendingViewer(), e.pendingViewer()
	items := []signedItem{e.signedItemFor(free), e.signedItemFor(busy)}
	before := e.gens(busy)

	holder := testenv.NewSession(t, e.url, "holder")
	holder.Begin()
	if _, err := holder.Tx.Exec(ctx, `SELECT 1 FROM buzz.visibility_state WHERE viewer = $1 FOR UPDATE`, busy); err != nil {
		t.Fatal(err)
	}

	pub := testenv.NewSession(t, e.url, "batch")
	var outs []string
	var perr error
	done := testenv.Async(func() { outs, perr = publishMany(ctx, pub.Conn, items) })
	if testenv.WaitBlockedOrDone(t, e.pool, pub.PID, done) {
		_ = holder.Tx.Rollback(ctx)
		<-done
		t.Fatal("the batch publication waited for the locked state row instead of skipping it as busy")
	}
	// Returned, and the row is still locked by the holder (a NOWAIT lock attempt is refused).
	if _, err := e.pool.Exec(ctx, `SELECT 1 FROM buzz.visibility_state WHERE viewer = $1 FOR UPDATE NOWAIT`, busy); db.SQLState(err) != "55P03" {
		t.Fatalf("the busy viewer's row is not held any more when the batch returned: %v", err)
	}
	if perr != nil {
		t.Fatalf("publishMany: %v", perr)
	}
	if len(outs) != 2 || outs[0] != OutcomePublished || outs[1] != OutcomeBusy {
		t.Fatalf("outcomes %v, want [published busy]", outs)
	}
	e.assertConverged(free)
	// Busy: nothing changed for that viewer.
	if g := e.gens(busy); g != before {
		t.Fatalf("busy viewer's generations moved: %+v -> %+v", before, g)
	}
	if ev, _ := e.head(busy); ev != nil {
		t.Fatalf("busy viewer got a snapshot %s", ev.ID)
	}
	var gen int64
	if err := e.pool.QueryRow(ctx, `SELECT generation FROM buzz.visibility_outbox WHERE viewer = $1`, busy).Scan(&gen); err != nil || gen != before.target {
		t.Fatalf("busy viewer's outbox row: generation %d, %v; want %d kept", gen, err, before.target)
	}

	if err := holder.Tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	e.start(e.publisher("A", nil))
	e.waitConverged([]string{free, busy}, 20*time.Second)
	e.assertAuditMonotonic()
}
