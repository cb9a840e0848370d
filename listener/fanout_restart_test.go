package listener

import (
	"context"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A real immediate (crash) restart of PostgreSQL: the stream reconnects by itself, and every event
// is delivered exactly once although PG 15 may resend what we had acknowledged. It runs on a private
// cluster of its own, so restarting it disturbs no other test package, and it never has to skip.
func TestFanoutSurvivesPostgresCrashRestart(t *testing.T) {
	cl := testenv.PrivateCluster(t, "listener-crash-restart")
	h := newFanHarnessAt(t, cl.MigratedURL(t))
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

	if err := cl.Restart(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 60*time.Second, "reattached after restart", func() bool { return f.sessions.Load() > sessions && f.Ready() })
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
