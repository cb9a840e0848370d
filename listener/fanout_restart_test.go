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

// An outage of the database longer than StaleAfter silences every process at once. The first one
// back must not take the others (whose beats are a heartbeat away, their streams in backoff) for
// dead and drop their slots: each process keeps the one slot it created.
func TestFanoutOutageLongerThanStaleAfterReapsNobody(t *testing.T) {
	cl := testenv.PrivateCluster(t, "listener-outage-reap")
	h := newFanHarnessAt(t, cl.MigratedURL(t))
	const stale = 2 * time.Second
	a, _ := h.start(FanoutConfig{InstanceID: fanInstance("outage_a"), StaleAfter: stale}, newFanRecSink(), nil)
	b, _ := h.start(FanoutConfig{InstanceID: fanInstance("outage_b"), StaleAfter: stale}, newFanRecSink(), nil)
	sa, sb := a.sessions.Load(), b.sessions.Load()
	if err := cl.Stop(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(stale + time.Second) // the scenario: an outage longer than StaleAfter
	if err := cl.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 60*time.Second, "both streams reattached", func() bool {
		return a.sessions.Load() > sa && b.sessions.Load() > sb && a.Ready() && b.Ready()
	})
	// Both have beaten since the restart, so a wrong reap would have happened by now; give it
	// StaleAfter more, when reaping becomes allowed again.
	started := time.Now()
	testenv.WaitUntil(t, 30*time.Second, "both beat twice after the restart and StaleAfter passed", func() bool {
		var n int
		_ = h.pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.instances
			WHERE slot_name IN ($1, $2) AND heartbeat_at > pg_postmaster_start_time() + $3::interval`,
			a.Slot(), b.Slot(), (2 * b.cfg.Heartbeat).String()).Scan(&n)
		return n == 2 && time.Since(started) > stale
	})
	if na, nb := a.slotsMade.Load(), b.slotsMade.Load(); na != 1 || nb != 1 {
		t.Fatalf("slots created: a %d, b %d; want 1 each (a slot was reaped after the outage)", na, nb)
	}
}
