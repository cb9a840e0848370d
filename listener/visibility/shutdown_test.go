package visibility

import (
	"context"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A publisher stopped while its claim statement is still running on the server must not lose the
// rows that claim takes: pgx drops a cancelled query on the client side only, so the server
// commits the claim anyway. Without the claim finishing under shutdown, the row would sit out
// the whole lease (an hour here) before anyone publishes the viewer again.
func TestSnapshotStopDuringClaimGivesRowsBack(t *testing.T) {
	e := newEnv(t)
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	blk := testenv.BlockClaims(t, e.pool, "buzz.visibility_outbox",
		"NEW.claim_id IS NOT NULL AND NEW.claim_id IS DISTINCT FROM OLD.claim_id")

	a := e.publisher("A", func(c *Config) { c.Lease = time.Hour })
	cancel, stopped := testenv.RunStoppable(t, a.Run)
	testenv.WaitUntil(t, 10*time.Second, "publisher A listening", a.listening)

	e.hide(viewer, x) // A is woken; its claim blocks inside the UPDATE
	// Stop A while the claim is half done.
	blk.StopWhileBlocked(cancel, func() { stopped(); testenv.CloseWithin(t, a.Close) })

	e.assertUnclaimed(viewer)
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
}

// A publisher stopped between a failed publication and the release of its row still gives the row
// back: the release fails at once (pgx does not send a statement on a cancelled context), and a
// release that fails leaves the claim with those Close releases. CI hit this window.
func TestSnapshotStopBeforeReleaseGivesRowBack(t *testing.T) {
	e := newEnv(t)
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	e.exec(`CREATE FUNCTION public.fail_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: snapshot storage down'; END $$;
		CREATE TRIGGER fail_snapshots BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.fail_snapshots();`)
	gate := pauseAt(t, HookBeforeRelease, "A")

	a := e.publisher("A", func(c *Config) { c.Lease = time.Hour })
	cancel, stopped := testenv.RunStoppable(t, a.Run)
	e.hide(viewer, x)
	gate.Wait(t) // A's publication failed; it is about to release the row
	cancel()     // the gate lets A go on with a cancelled context
	stopped()
	testenv.CloseWithin(t, a.Close)
	e.assertUnclaimed(viewer)
	e.exec(`DROP TRIGGER fail_snapshots ON buzz.events`)
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
}

func (e *env) assertUnclaimed(viewer string) {
	e.t.Helper()
	var held bool
	if err := e.pool.QueryRow(context.Background(),
		`SELECT claim_id IS NOT NULL FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&held); err != nil {
		e.t.Fatal(err)
	}
	if held {
		e.t.Fatal("the outbox row is still claimed after the publisher stopped: it waits out the hour-long lease")
	}
}
