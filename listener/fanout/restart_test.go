package fanout

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A real immediate (crash) restart of PostgreSQL: the stream reconnects by itself, and every event
// is delivered exactly once although PG 15 resends what we had acknowledged. It runs on a private
// cluster of its own, so restarting it disturbs no other test package, and it never has to skip.
//
// The server starts a session at the later of the LSN asked for and the slot's confirmed
// position, and the stream asks for its own last hand-off, so a stream that simply reconnects is
// never sent anything again (measured: 0 resent). What PostgreSQL 15 loses in a crash is the
// slot's confirmed position: it is written to disk only now and then (at checkpoints, and when a
// new restart point is confirmed), so after the crash the slot is back behind what we had
// acknowledged. To have that rewound position served, the first session after the crash asks for
// the slot's own position (start 0, as a stream without a position of its own would), and the
// server resends the acknowledged transactions after it, among them the due signal emitted last
// before the crash: the stream's own position must drop every one of them.
func TestFanoutSurvivesPostgresCrashRestart(t *testing.T) {
	cl := testenv.PrivateCluster(t, "listener-crash-restart")
	h := newHarnessAt(t, cl.MigratedURL(t))
	ctx := context.Background()
	sink := newRecSink()
	crashed := make(chan struct{})
	// Acknowledge often so the server has a confirmed position it may have to rewind after the crash.
	f, _ := h.start(Config{StatusInterval: 50 * time.Millisecond}, sink, func(f *Fanout) {
		f.startHook = func(last pglogrepl.LSN) pglogrepl.LSN {
			select {
			case <-crashed:
				return 0 // whatever position the slot kept through the crash
			default:
				return last
			}
		}
	})
	// Pin the slot's restart point before the events: a transaction that has written something
	// stays open until the crash, so no restart point past its first change can be confirmed, and
	// the slot is not saved to disk again (the confirmed position alone is kept in memory only).
	// Without it a standby snapshot logged just after the events (the background writer's, every
	// 15 s) could let the slot be saved with everything confirmed, and nothing would be resent.
	pin := testenv.NewSession(t, cl.MigratedURL(t), "restart-pin")
	if _, err := pin.Conn.Exec(ctx, `CREATE TABLE public.restart_pin (x int)`); err != nil {
		t.Fatal(err)
	}
	pin.Begin()
	if _, err := pin.Conn.Exec(ctx, `INSERT INTO public.restart_pin VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	var keys []string
	for i := 0; i < 200; i++ {
		ev := signedEvent(1, "before crash", nil)
		h.accept(ctx, ev)
		keys = append(keys, ev.ID)
	}
	// A due signal (a transactional logical message), the last thing before the crash.
	rem := signedEvent(30300, "enc", nostr.Tags{{"d", "crash"}})
	h.emit(ctx, map[string]any{"t": "due", "ev": rem, "stamp": 77, "scope": "a"})
	dueKey := rem.ID + "/77"
	keys = append(keys, dueKey)
	sink.waitAll(t, keys, 20*time.Second)
	// Everything, the due signal included, is acknowledged before the crash.
	var walEnd pglogrepl.LSN
	if err := h.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&walEnd); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 20*time.Second, "the stream acknowledged everything", func() bool {
		var confirmed pglogrepl.LSN
		err := h.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, f.slot).Scan(&confirmed)
		return err == nil && confirmed >= walEnd
	})
	sessions := f.sessions.Load()

	close(crashed)
	if err := cl.Restart(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 60*time.Second, "reattached after restart", func() bool { return f.sessions.Load() > sessions && f.Ready() })
	for i := 0; i < 50; i++ {
		ev := signedEvent(1, "after crash", nil)
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
	if n := sink.count(dueKey); n != 1 {
		t.Fatalf("the due signal emitted before the crash was delivered %d times, want 1", n)
	}
	skippedTxn, skippedDup := f.skippedTxn.Load(), f.skippedDup.Load()
	t.Logf("skipped resent transactions: %d, duplicate ids: %d", skippedTxn, skippedDup)
	if skippedTxn+skippedDup == 0 {
		t.Fatal("nothing was resent after the crash: the test did not exercise the de-duplication")
	}
}

// An outage of the database longer than StaleAfter silences every process at once. The first one
// back must not take the others (whose beats are a heartbeat away, their streams in backoff) for
// dead and drop their slots: each process keeps the one slot it created.
func TestFanoutOutageLongerThanStaleAfterReapsNobody(t *testing.T) {
	cl := testenv.PrivateCluster(t, "listener-outage-reap")
	h := newHarnessAt(t, cl.MigratedURL(t))
	const stale = 2 * time.Second
	a, _ := h.start(Config{InstanceID: instanceID("outage_a"), StaleAfter: stale}, newRecSink(), nil)
	b, _ := h.start(Config{InstanceID: instanceID("outage_b"), StaleAfter: stale}, newRecSink(), nil)
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
			a.slot, b.slot, (2 * b.cfg.Heartbeat).String()).Scan(&n)
		return n == 2 && time.Since(started) > stale
	})
	if na, nb := a.slotsMade.Load(), b.slotsMade.Load(); na != 1 || nb != 1 {
		t.Fatalf("slots created: a %d, b %d; want 1 each (a slot was reaped after the outage)", na, nb)
	}
}

// A session that fails right after attaching, again and again, backs off: 100 ms doubling to the
// 5 s cap. Before, any attach reset the backoff, so such a loop reconnected about ten times a
// second for good. The walsender is terminated right after each attach (attachedHook) and the
// backoff's waits are recorded instead of slept.
func TestFanoutBackoffGrowsWhenSessionsEndRightAfterAttaching(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	instance := instanceID("bo")
	const kills = 7
	var mu sync.Mutex
	var killed int
	var bases []time.Duration
	f, _ := h.start(Config{InstanceID: instance}, newRecSink(), func(f *Fanout) {
		f.attachedHook = func() {
			mu.Lock()
			defer mu.Unlock()
			if killed < kills {
				killed++
				if _, err := h.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1`, SlotName(instance)); err != nil {
					t.Errorf("terminate the walsender: %v", err)
				}
			}
		}
		f.waitHook = func(base time.Duration) bool {
			mu.Lock()
			defer mu.Unlock()
			bases = append(bases, base)
			return true
		}
	})
	testenv.WaitUntil(t, 30*time.Second, "seven sessions ended and an eighth attached", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return killed == kills && len(bases) >= kills && f.Ready()
	})
	mu.Lock()
	defer mu.Unlock()
	var want []time.Duration
	for _, ms := range []time.Duration{100, 200, 400, 800, 1600, 3200, 5000} {
		want = append(want, ms*time.Millisecond)
	}
	if !slices.Equal(bases[:kills], want) {
		t.Fatalf("backoff bases %v, want %v (doubling to the cap)", bases, want)
	}
}
