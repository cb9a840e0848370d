package tests

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/fanout"
	"github.com/buzzpg/buzzpg/listener/visibility"
)

// shutdownBound is README's worst case of a graceful shutdown (the BUZZ_SHUTDOWN_GRACE row):
// BUZZ_SHUTDOWN_GRACE and 1 s (relay.KillWait) for the client drain, 10 s for the components to stop, 5 s for the releases
// (run side by side) and 1 s for the pools; 27 s with the default 10 s drain.
func shutdownBound(grace time.Duration) time.Duration { return grace + 17*time.Second }

// A graceful shutdown while the database has stopped answering (packets vanish: no refusal, no
// reset) ends within the documented bound, with every step at its worst: a client that never
// answers the close handshake keeps the drain busy for its whole grace (1 s here: the relay cuts
// such a client after 2 s), the scheduler's own roll-back on the way out keeps the components
// busy for theirs, and the process holds a snapshot claim, a reminder claim and its slot, whose
// releases each wait for their whole grace; the pools then hold connections pgx is still
// tearing down. Before the releases ran side by side and the pools closed together, this took
// 15 s more, and with the default drain past Kubernetes' 30 s.
func TestShutdownWithinItsBoundWhenTheDatabaseIsUnreachable(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	proxy := testenv.StartTCPProxy(t, testenv.TargetOf(t, dbURL))
	const grace = time.Second
	h := startHolding(t, pool, proxy.ProxyURL(t, dbURL), grace)

	proxy.BlackHole()
	began := time.Now()
	if err := syscall.Kill(h.r.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	bound := shutdownBound(grace)
	// The margin absorbs scheduling on a loaded machine, not a step: every step is bounded by a timer.
	const margin = 3 * time.Second
	select {
	case <-h.r.Done():
	case <-time.After(3 * bound):
		h.r.Kill()
	}
	took := time.Since(began)
	t.Logf("shutdown with the database unreachable took %s (bound %s)\n%s", took.Round(10*time.Millisecond), bound, shutdownLines(h.r.LogPath))
	if took > bound+margin {
		t.Fatalf("shutdown took %s, over its documented bound of %s (+%s margin)", took.Round(10*time.Millisecond), bound, margin)
	}
	if code := h.r.ExitCode(); code != 0 {
		t.Fatalf("exit %d after SIGTERM", code)
	}
	// Nothing reached the database, so the claims wait out their leases: had a release got
	// through, the test would have measured a shutdown that did not wait for it.
	if !h.outboxClaimed(t) {
		t.Fatal("the outbox row was released through the black hole: the test measured nothing")
	}
}

// The same shutdown with the database answering: the three releases, run side by side on the
// listener pool, all happen. The snapshot claim is given back, the reminder claim rolled back,
// the slot and the instance row are gone, well within the bound.
func TestShutdownReleasesClaimsAndSlotSideBySide(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	const grace = time.Second
	h := startHolding(t, pool, dbURL, grace)

	began := time.Now()
	h.r.Stop() // SIGTERM
	took := time.Since(began)
	if code := h.r.ExitCode(); code != 0 {
		t.Fatalf("exit %d after SIGTERM:\n%s", code, h.r.Log())
	}
	t.Logf("shutdown took %s", took.Round(10*time.Millisecond))
	if h.outboxClaimed(t) {
		t.Error("the outbox row is still claimed after a graceful shutdown: it waits out the hour-long lease")
	}
	if st := remGet(t, pool, h.rem).State; st != "armed" {
		t.Errorf("reminder after a graceful shutdown is %s, want armed (rolled back, not held for the lease)", st)
	}
	slot := fanout.SlotName(h.r.InstanceID)
	if n := testenv.MustInt(t, pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot); n != 0 {
		t.Errorf("slot %s survived a graceful shutdown", slot)
	}
	if n := testenv.MustInt(t, pool, `SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, h.r.InstanceID); n != 0 {
		t.Errorf("instance row survived a graceful shutdown")
	}
	if took > shutdownBound(grace) {
		t.Errorf("shutdown with the database answering took %s, over the bound %s", took, shutdownBound(grace))
	}
}

// holding is a serve process that holds, at its hooks, a snapshot claim and a reminder claim
// (besides its slot), with a client connected that never answers the close handshake.
type holding struct {
	r      *testenv.Relay
	pool   *pgxpool.Pool
	viewer string
	rem    string // reminder id
}

func startHolding(t *testing.T, pool *pgxpool.Pool, serveURL string, grace time.Duration) *holding {
	t.Helper()
	hookDir := t.TempDir()
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: serveURL, HookDir: hookDir,
		Hooks: []string{visibility.HookBeforeFence, "reminder.after_claim"},
		Env:   map[string]string{"BUZZ_SHUTDOWN_GRACE": grace.String(), "BUZZ_LEASE": "1h", "BUZZ_REMINDER_LEASE": "1h"}})
	viewer, ch := snapSQLDM(t, pool)
	snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, ch)
	hooks.Wait(t, hookDir, visibility.HookBeforeFence, 30*time.Second)
	rem := remDue(t, pool)
	hooks.Wait(t, hookDir, "reminder.after_claim", 30*time.Second)
	if st := remGet(t, pool, rem.ID).State; st != "claimed" {
		t.Fatalf("reminder at the hook is %s, want claimed", st)
	}
	h := &holding{r: r, pool: pool, viewer: viewer, rem: rem.ID}
	if !h.outboxClaimed(t) {
		t.Fatal("outbox row not claimed at the hook")
	}
	ws, _, err := websocket.DefaultDialer.Dial(r.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ws.Close() })
	return h
}

func (h *holding) outboxClaimed(t *testing.T) bool {
	t.Helper()
	var held bool
	if err := h.pool.QueryRow(context.Background(), `SELECT claim_id IS NOT NULL FROM buzz.visibility_outbox WHERE viewer = $1`, h.viewer).Scan(&held); err != nil {
		t.Fatal(err)
	}
	return held
}

// shutdownLines are the log lines from the shutdown on, for the figures of a run.
func shutdownLines(logPath string) string {
	b, _ := os.ReadFile(filepath.Clean(logPath))
	s := string(b)
	if i := strings.Index(s, "shutting down"); i >= 0 {
		if j := strings.LastIndex(s[:i], "\n"); j >= 0 {
			s = s[j+1:]
		}
	}
	return regexp.MustCompile(`"level":"DEBUG"[^\n]*\n`).ReplaceAllString(s, "")
}
