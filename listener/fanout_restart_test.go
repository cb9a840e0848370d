package listener

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A real immediate (crash) restart of PostgreSQL: the stream reconnects by itself, and every event
// is delivered exactly once although PG 15 may resend what we had acknowledged. It restarts the
// shared private cluster, which disturbs other test packages running at the same time, so it runs
// only when asked: BUZZ_TEST_PG_RESTART=1.
func TestFanoutSurvivesPostgresCrashRestart(t *testing.T) {
	if os.Getenv("BUZZ_TEST_PG_RESTART") != "1" {
		t.Skip("set BUZZ_TEST_PG_RESTART=1 to restart the private PostgreSQL cluster (disturbs concurrently running packages)")
	}
	if !testenv.OwnsServer() {
		t.Skip("DATABASE_URL points at a server this test does not own; not restarting it")
	}
	h := newFanHarness(t)
	ctx := context.Background()
	sink := newFanRecSink()
	// Acknowledge often so the server has a confirmed position it may have to rewind after the crash.
	f, _ := h.start(FanoutConfig{StatusInterval: 50 * time.Millisecond}, sink, nil)
	var keys []string
	for i := 0; i < 200; i++ {
		ev := fanSigned(1, "before crash", nil)
		h.accept(ctx, ev)
		keys = append(keys, ev.ID)
	}
	sink.waitAll(t, keys, 20*time.Second)
	sessions := f.sessions.Load()

	out, err := exec.Command(filepath.Join(testenv.RepoRoot(), "scripts", "pg.sh"), "restart").CombinedOutput()
	if err != nil {
		t.Fatalf("pg.sh restart: %v: %s", err, out)
	}
	fanWaitCond(t, 60*time.Second, "reattached after restart", func() bool { return f.sessions.Load() > sessions && f.Ready() })
	for i := 0; i < 50; i++ {
		ev := fanSigned(1, "after crash", nil)
		for {
			// The pool's connections died with the server; the first use may fail once.
			b, _ := ev.MarshalJSON()
			if _, err := h.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(b)); err == nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		keys = append(keys, ev.ID)
	}
	sink.waitAll(t, keys, 30*time.Second)
	sink.assertExactlyOnce(t, keys)
	t.Logf("skipped resent transactions: %d, duplicate ids: %d", f.skippedTxn.Load(), f.skippedDup.Load())
}
