package tests

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/visibility"
)

// A graceful shutdown whose client drain uses up BUZZ_SHUTDOWN_GRACE still gives back the
// publisher's claim: the releases get their own time once the components have stopped (before,
// Close got the drain's expired context, and the row waited out its lease, an hour here).
func TestShutdownAfterALongDrainReleasesClaims(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	hookDir := t.TempDir()
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, HookDir: hookDir,
		Hooks: []string{visibility.HookBeforeFence},
		Env:   map[string]string{"BUZZ_SHUTDOWN_GRACE": "1s", "BUZZ_LEASE": "1h"}})

	viewer, ch := snapSQLDM(t, pool)
	snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, ch)
	hooks.Wait(t, hookDir, visibility.HookBeforeFence, 30*time.Second) // the publisher holds the claim

	// A client that never answers the close handshake keeps the drain busy for the whole grace.
	ws, _, err := websocket.DefaultDialer.Dial(r.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ws.Close()

	r.Stop() // SIGTERM
	if code := r.ExitCode(); code != 0 {
		t.Fatalf("serve exited with %d:\n%s", code, r.Log())
	}
	var held bool
	if err := pool.QueryRow(ctx, `SELECT claim_id IS NOT NULL FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&held); err != nil {
		t.Fatal(err)
	}
	if held {
		t.Fatal("the outbox row is still claimed after a graceful shutdown: it waits out the hour-long lease")
	}
	if !strings.Contains(r.Log(), "released its claims") {
		t.Fatal("serve did not log giving its claims back")
	}
}

// A second SIGTERM during a graceful shutdown stops the process at once: it dies by the signal
// instead of finishing the shutdown and exiting 0. The shutdown is kept busy for seconds, so the
// second signal lands inside it even on a loaded machine: the publisher's claim is held inside
// the server (a trigger waits for an advisory lock this test holds) and gets its grace to finish.
func TestSecondSignalStopsAtOnce(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	holder, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release()
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock(808080)`); err != nil {
		t.Fatal(err)
	}
	defer holder.Exec(ctx, `SELECT pg_advisory_unlock_all()`) //nolint:errcheck // the test is over
	snapExec(t, pool, `
		CREATE FUNCTION public.hold_claims() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock(808080); RETURN NEW; END $$;
		CREATE TRIGGER hold_claims BEFORE UPDATE ON buzz.visibility_outbox
		  FOR EACH ROW WHEN (NEW.claim_id IS NOT NULL) EXECUTE FUNCTION public.hold_claims();`)

	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, Env: map[string]string{"BUZZ_SHUTDOWN_GRACE": "1m"}})
	viewer, ch := snapSQLDM(t, pool)
	snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, ch)
	testenv.WaitUntil(t, 30*time.Second, "the publisher's claim held in the trigger", func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event = 'advisory' AND application_name LIKE 'buzzpg-%'`).Scan(&n)
		return n > 0
	})

	if err := syscall.Kill(r.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 30*time.Second, "the shutdown line", func() bool {
		return strings.Contains(r.Log(), "a second signal stops at once")
	})
	if err := syscall.Kill(r.Pid(), syscall.SIGTERM); err != nil {
		t.Fatalf("second SIGTERM: %v (the shutdown was already over: the test's window is too short)", err)
	}
	<-r.Done()
	var exit *exec.ExitError
	if !errors.As(r.ExitErr(), &exit) || !exit.Sys().(syscall.WaitStatus).Signaled() {
		t.Fatalf("serve finished its shutdown (%v) instead of dying by the second SIGTERM:\n%s", r.ExitErr(), r.Log())
	}
}
