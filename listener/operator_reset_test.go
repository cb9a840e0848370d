package listener

import (
	"context"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// An operator resets a viewer by deleting their visibility_state row while a publication is
// pending. The outbox row goes with it (before 0010 it stayed, came back 'stale' from every
// publication and was claimed again after each lease, forever); the viewer's next change starts
// over at generation 1 and converges.
func TestOperatorResetOfVisibilityState(t *testing.T) {
	e := newPubEnv(t)
	ctx := context.Background()
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	e.hide(viewer, x)
	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer)
	var rows int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 0 {
		t.Fatal("the outbox row outlived its viewer's state row")
	}
	var pending int64
	if err := e.pool.QueryRow(ctx, `SELECT pending_viewers FROM buzz.visibility_lag()`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if pending != 0 {
		t.Fatalf("visibility_lag counts %d pending viewers after the reset", pending)
	}

	e.start(e.publisher("A", nil))
	e.unhide(viewer, x)
	if g := e.gens(viewer); g.target != 1 {
		t.Fatalf("after the reset the next change is generation %d, want 1", g.target)
	}
	e.waitConverged([]string{viewer}, 10*time.Second)
	if _, hs := e.head(viewer); len(hs) != 0 {
		t.Fatalf("snapshot after unhide: %v, want none hidden", hs)
	}
}

// A publisher read the viewer's source (generation 3, X hidden) before the operator's reset; the
// restarted state reaches generation 1 with nothing hidden. The old generation is above anything
// the state has now: the fence sends the publisher back to re-read (before 0010 it published
// generation 3 with X hidden, and generations 1 to 3 of the new state counted as done).
func TestOperatorResetFencesAnOlderRead(t *testing.T) {
	e := newPubEnv(t)
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	e.hide(viewer, x)
	e.unhide(viewer, x)
	e.hide(viewer, x)
	if g := e.gens(viewer); g.target != 3 {
		t.Fatalf("setup: generation %d, want 3", g.target)
	}

	a := e.publisher("A", nil)
	gate := pauseAt(t, HookBeforeFence, "A")
	type res struct {
		out string
		err error
	}
	done := make(chan res, 1)
	go func() { o, err := a.PublishViewer(context.Background(), viewer); done <- res{o, err} }()
	gate.wait(t) // A holds generation 3 with X hidden

	e.exec(`DELETE FROM buzz.visibility_state WHERE viewer = $1`, viewer)
	e.unhide(viewer, x) // the restarted state: generation 1, nothing hidden
	gate.open()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	g := e.gens(viewer)
	_, hs := e.head(viewer)
	if g.published != g.target || len(hs) != 0 {
		t.Fatalf("after the reset: published %d, target %d, head hides %v; want the restarted generation with nothing hidden (A answered %q)",
			g.published, g.target, hs, r.out)
	}
}
