package visibility

import (
	"context"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// An operator resets a viewer by deleting their visibility_state row while a publication is
// pending. The old outbox row goes with it (kept, it would come back 'stale' from every
// publication and be claimed again after each lease, forever). The pending change is not lost
// (or the snapshot would keep the state from before the hide until the viewer's next change): the
// row is made again, pending above every generation the deleted row had (not starting over at 1),
// and converges on the current state (sql/0003_visibility).
func TestOperatorResetOfVisibilityState(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x := e.hiddenViewer() // generation 1, pending
	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer)
	if g := e.gens(viewer); g.published != 1 || g.target != 2 {
		t.Fatalf("after resetting a pending viewer: published %d, target %d; want 1, 2 (pending above the deleted row's 1)",
			g.published, g.target)
	}
	if rows := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1 AND generation = 2`, viewer); rows != 1 {
		t.Fatalf("%d outbox rows for the re-made generation 2, want 1", rows)
	}
	var pending int64
	if err := e.pool.QueryRow(ctx, `SELECT pending_viewers FROM buzz.visibility_lag()`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 1 {
		t.Fatalf("visibility_lag counts %d pending viewers after the reset, want 1", pending)
	}

	// Started only now: a publisher already running could publish generation 2 before the checks
	// above read it. It finds the pending change in the outbox, like any publisher starting.
	e.start(e.publisher("A", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
	if _, hs := e.head(viewer); len(hs) != 1 || hs[0] != x {
		t.Fatalf("snapshot after the reset: %v, want the hide made before it (%s)", hs, x)
	}
	e.unhide(viewer, x)
	e.waitConverged([]string{viewer}, 10*time.Second)
	if _, hs := e.head(viewer); len(hs) != 0 {
		t.Fatalf("snapshot after unhide: %v, want none hidden", hs)
	}
}

// A viewer with nothing pending is reset to nothing: no row, no work; their next change starts
// above the generations the deleted row had.
func TestOperatorResetOfAConvergedViewer(t *testing.T) {
	e := newEnv(t)
	viewer, x := e.hiddenViewer()
	stop := e.start(e.publisher("A", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
	stop()
	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer)
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_state WHERE viewer = $1`, viewer); n != 0 {
		t.Fatalf("%d state rows after resetting a converged viewer, want 0", n)
	}
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1`, viewer); n != 0 {
		t.Fatalf("%d outbox rows after resetting a converged viewer, want 0", n)
	}
	e.unhide(viewer, x)
	if g := e.gens(viewer); g.published != 1 || g.target != 2 {
		t.Fatalf("after the reset the next change: published %d, target %d; want 1, 2", g.published, g.target)
	}
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
}

// A publisher read the viewer's source (generation 3, X hidden) before the operator's reset, and
// resumes after the restarted state changed (X no longer hidden). Were generations to start over
// at 1, it would publish X hidden as generation 3 over a restarted state at generation 1, and
// generations 1 to 3 of the new state would count as done. The CHECK (published <= target)
// catches that case but not the one where the restarted state climbs back to generation 3 before
// the publisher resumes: 0 < 3 would pass the fence and 3 <= 3 the CHECK, X hidden would be
// published as generation 3 and the outbox cleared, and the viewer would stay wrong until their
// next change. So the restarted state starts above every generation the viewer ever had
// (sql/0003_visibility): the old read is 'stale', and the viewer converges on the new state.
func TestOperatorResetFencesAnOlderRead(t *testing.T) {
	for _, tc := range []struct {
		name    string
		changes int // changes of the restarted state before the publisher resumes (odd: X visible)
	}{
		{"one change", 1},
		{"back to the read's generation", 3},
		{"past the read's generation", 5},
	} {
		t.Run(tc.name, func(t *testing.T) { olderReadAcrossReset(t, tc.changes) })
	}
}

func olderReadAcrossReset(t *testing.T, changes int) {
	e := newEnv(t)
	viewer, x := e.hiddenViewer()
	e.unhide(viewer, x)
	e.hide(viewer, x)
	before := e.gens(viewer)
	if before.target != 3 {
		t.Fatalf("setup: generation %d, want 3", before.target)
	}

	_, gate, done := e.pausedPublisher("A", viewer) // A holds generation 3 with X hidden

	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer)
	for i := 0; i < changes; i++ { // unhide, hide, unhide, ...
		if i%2 == 0 {
			e.unhide(viewer, x)
		} else {
			e.hide(viewer, x)
		}
	}
	hidden := e.hiddenSet(viewer)
	if want := 1 - changes%2; len(hidden) != want {
		t.Fatalf("setup: %d hidden after %d changes, want %d", len(hidden), changes, want)
	}
	gate.Open()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	if _, hs := e.head(viewer); len(hs) != 0 {
		g := e.gens(viewer)
		t.Fatalf("A published its read from before the reset: head hides %v at published %d, target %d (A answered %q)",
			hs, g.published, g.target, r.out)
	}

	// Whatever A answered ('stale', as generations never repeat), the viewer converges on the restarted state.
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
	e.assertAuditMonotonic() // no generation of this viewer was published twice
	if g := e.gens(viewer); g.published <= before.target {
		t.Fatalf("after the reset: published generation %d, want above the read's %d", g.published, before.target)
	}
}

// A change of the viewer races the reset itself: it read buzz.visibility_retired while the delete
// was not committed yet, then waited for the deleted row and inserted a new one that was not lifted
// (it would restart at generation 1 and repeat 1 to 3). The state's insert check refuses it with
// SQLSTATE 40001, which Go retries; the retry starts above the retired generation. When the
// viewer had a change pending, the reset makes the row again itself: the change waits for that row
// and lands above it, with no refusal (sql/0003_visibility).
func TestOperatorResetRacingAChange(t *testing.T) {
	t.Run("nothing pending", func(t *testing.T) { resetRacingAChange(t, false) })
	t.Run("change pending", func(t *testing.T) { resetRacingAChange(t, true) })
}

func resetRacingAChange(t *testing.T, pending bool) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x := e.hiddenViewer()
	e.unhide(viewer, x)
	e.hide(viewer, x)
	if !pending {
		stop := e.start(e.publisher("A", nil))
		e.waitConverged([]string{viewer}, 10*time.Second)
		stop()
	}

	reset, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reset.Rollback(ctx)
	if _, err := reset.Exec(ctx, `DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer); err != nil {
		t.Fatal(err)
	}
	change := testenv.NewSession(t, e.url, "change")
	var changeErr error
	done := testenv.Async(func() {
		_, changeErr = change.Conn.Exec(ctx, `SELECT buzz.unhide_dm($1, $2::uuid)`, viewer, x)
	})
	if !testenv.WaitBlockedOrDone(t, e.pool, change.PID, done) {
		t.Fatal("the change did not wait for the uncommitted reset")
	}
	if err := reset.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	if pending {
		if changeErr != nil {
			t.Fatalf("the change racing the reset of a pending viewer: %v, want it to wait and succeed", changeErr)
		}
		if g := e.gens(viewer); g.published != 3 || g.target != 5 {
			t.Fatalf("after the change: published %d, target %d; want 3, 5 (the reset's re-made 3, 4, then the change)", g.published, g.target)
		}
		e.start(e.publisher("B", nil))
		e.waitConverged([]string{viewer}, 10*time.Second)
		return
	}
	if err := changeErr; !db.Retryable(err) {
		g := e.gens(viewer)
		t.Fatalf("the change racing the reset: err %v, published %d, target %d; want a retryable refusal", err, g.published, g.target)
	}
	e.unhide(viewer, x) // the retry
	if g := e.gens(viewer); g.published != 3 || g.target != 4 {
		t.Fatalf("after the retry: published %d, target %d; want 3, 4 (above the reset's 3)", g.published, g.target)
	}
}

// TRUNCATE fires no row triggers: a statement trigger records every viewer's generation before
// one, so a truncated state restarts above it like a deleted row, and a viewer with an unpublished
// change is made pending again above it, so the change is not lost (sql/0003_visibility).
func TestOperatorTruncateOfVisibilityState(t *testing.T) {
	e := newEnv(t)
	viewer, x := e.hiddenViewer()
	e.unhide(viewer, x) // generation 2, pending: published shows nothing yet
	converged, y := e.hiddenViewer()
	stop := e.start(e.publisher("A", nil))
	e.waitConverged([]string{viewer, converged}, 10*time.Second)
	stop()
	e.hide(viewer, x) // generation 3, unpublished
	e.exec(`TRUNCATE buzz.visibility_state CASCADE`)
	if g := e.gens(viewer); g.published != 3 || g.target != 4 {
		t.Fatalf("after TRUNCATE the pending viewer: published %d, target %d; want 3, 4", g.published, g.target)
	}
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_state WHERE viewer = $1`, converged); n != 0 {
		t.Fatalf("%d state rows for the converged viewer after TRUNCATE, want 0", n)
	}
	if n := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_reset_pending`); n != 0 {
		t.Fatalf("visibility_reset_pending keeps %d rows after the TRUNCATE, want 0", n)
	}
	e.unhide(converged, y)
	if g := e.gens(converged); g.published != 1 || g.target != 2 {
		t.Fatalf("after TRUNCATE the next change: published %d, target %d; want 1, 2", g.published, g.target)
	}
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer, converged}, 10*time.Second)
	if _, hs := e.head(viewer); len(hs) != 1 || hs[0] != x {
		t.Fatalf("snapshot after TRUNCATE: %v, want the hide made before it (%s)", hs, x)
	}
}

// TRUNCATE of the member rows (itself, or cascaded from channels) empties every hidden set at
// once with no row trigger; every viewer's generation must move, or each snapshot would keep its
// hidden DMs for good. Also when the same statement truncates the state table, whatever the order.
func TestOperatorTruncateOfMembersRepublishes(t *testing.T) {
	for _, stmt := range []string{`TRUNCATE buzz.members`, `TRUNCATE buzz.channels CASCADE`,
		// With the state table too, named first: its BEFORE trigger runs before the members' one.
		`TRUNCATE buzz.visibility_state, buzz.members CASCADE`, `TRUNCATE buzz.visibility_state, buzz.channels CASCADE`} {
		t.Run(stmt, func(t *testing.T) {
			e := newEnv(t)
			a, x := e.hiddenViewer()
			b, y := e.hiddenViewer()
			e.start(e.publisher("A", nil))
			e.waitConverged([]string{a, b}, 10*time.Second)
			if _, hs := e.head(a); len(hs) != 1 || hs[0] != x {
				t.Fatalf("setup: snapshot of a hides %v, want %s", hs, x)
			}
			before := e.gens(b)
			e.exec(stmt)
			if g := e.gens(b); g.target != before.target+1 {
				t.Fatalf("%s: target generation %d, want %d (one bump per viewer with a hidden DM)", stmt, g.target, before.target+1)
			}
			e.waitConverged([]string{a, b}, 10*time.Second)
			for v, ch := range map[string]string{a: x, b: y} {
				if _, hs := e.head(v); len(hs) != 0 {
					t.Fatalf("%s: snapshot still hides %v (was %s), want none", stmt, hs, ch)
				}
			}
		})
	}
}
