package listener

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A publisher stopped while its claim statement is still running on the server must not lose the
// rows that claim takes: pgx drops a cancelled query on the client side only, so the server
// commits the claim anyway. Without the claim finishing under shutdown, the row would sit out
// the whole lease (an hour here) before anyone publishes the viewer again.
func TestSnapshotStopDuringClaimGivesRowsBack(t *testing.T) {
	e := newPubEnv(t)
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	blk := blockClaims(t, e.pool, "buzz.visibility_outbox",
		"NEW.claim_id IS NOT NULL AND NEW.claim_id IS DISTINCT FROM OLD.claim_id")

	a := e.publisher("A", func(c *PublisherConfig) { c.Lease = time.Hour })
	cancel, stopped := runStoppable(t, a.Run)
	testenv.WaitUntil(t, 10*time.Second, "publisher A listening", a.Listening)

	e.hide(viewer, x) // A is woken; its claim blocks inside the UPDATE
	pid := blk.waitBlocked()
	cancel() // stop A while the claim is half done
	blk.release()
	stopped()
	closeWithin(t, a.Close)
	blk.waitDone(pid)
	blk.drop()

	e.assertUnclaimed(viewer)
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
}

// The same for reminders: a scheduler stopped mid-claim rolls its claim back, so another one
// fires the reminder at once instead of after the lease.
func TestSchedulerStopDuringClaimRollsBack(t *testing.T) {
	e := newRemEnv(t)
	blk := blockClaims(t, e.pool, "buzz.reminders", "NEW.state = 'claimed' AND OLD.state <> 'claimed'")
	ev := e.store(time.Now().Unix() - 1)

	s := NewScheduler(SchedulerConfig{InstanceID: "stopping", DatabaseURL: e.url, Lease: time.Hour,
		Logger: slog.New(slog.NewTextHandler(remTLog{t}, nil))}, e.pool)
	cancel, stopped := runStoppable(t, s.Run) // its first batch claims the due reminder and blocks
	pid := blk.waitBlocked()
	cancel()
	blk.release()
	stopped()
	blk.waitDone(pid)
	blk.drop()

	if st, rb, _ := e.state(ev.ID); st != "armed" || rb != 1 {
		t.Fatalf("after stopping mid-claim: %s with %d rollbacks, want armed/1 (not held for the lease)", st, rb)
	}
	e.start("other", SchedulerConfig{})
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v", due)
	}
}

// A publisher stopped between a failed publication and the release of its row still gives the row
// back: the release fails at once (pgx does not send a statement on a cancelled context), and a
// release that fails leaves the claim with those Close releases. CI hit this window.
func TestSnapshotStopBeforeReleaseGivesRowBack(t *testing.T) {
	e := newPubEnv(t)
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	e.exec(`CREATE FUNCTION public.fail_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: snapshot storage down'; END $$;
		CREATE TRIGGER fail_snapshots BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.fail_snapshots();`)
	gate := pauseAt(t, HookBeforeRelease, "A")

	a := e.publisher("A", func(c *PublisherConfig) { c.Lease = time.Hour })
	cancel, stopped := runStoppable(t, a.Run)
	e.hide(viewer, x)
	gate.wait(t) // A's publication failed; it is about to release the row
	cancel()     // the gate lets A go on with a cancelled context
	stopped()
	closeWithin(t, a.Close)
	e.assertUnclaimed(viewer)
	e.exec(`DROP TRIGGER fail_snapshots ON buzz.events`)
	e.start(e.publisher("B", nil))
	e.waitConverged([]string{viewer}, 10*time.Second)
}

// runStoppable runs run in the background; cancel stops it, stopped waits until it returned nil.
func runStoppable(t *testing.T, run func(context.Context) error) (cancel context.CancelFunc, stopped func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(cancel)
	return cancel, func() {
		t.Helper()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("did not stop")
		}
	}
}

func closeWithin(t *testing.T, close func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := close(ctx); err != nil {
		t.Fatal(err)
	}
}

func (e *pubEnv) assertUnclaimed(viewer string) {
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
