package reminders

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A due reminder that another transaction holds (an operator's open UPDATE, say) is skipped by
// every claim (SKIP LOCKED) and keeps the next wake-up in the past. The scheduler must not
// re-poll it every MinInterval for as long as that transaction lasts: its waits double, and the
// reminder still fires once the row is free.
func TestSchedulerBacksOffFromADueReminderItCannotClaim(t *testing.T) {
	e := newEnv(t)
	ev := e.store(time.Now().Unix() - 1)
	holder := testenv.NewSession(t, e.url, "row-holder")
	holder.Begin()
	if _, err := holder.Conn.Exec(context.Background(), `SELECT 1 FROM buzz.reminders WHERE id = $1 FOR UPDATE`, ev.ID); err != nil {
		t.Fatal(err)
	}

	const passes = 6
	var mu sync.Mutex
	var waits []time.Duration
	enough := make(chan struct{})
	s := NewScheduler(Config{InstanceID: "backoff", DatabaseURL: e.url, MinInterval: 10 * time.Millisecond,
		MaxSleep: time.Hour, Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	s.onWait = func(d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		if waits = append(waits, d); len(waits) == passes {
			close(enough)
		}
	}
	_, stopped := testenv.RunStoppable(t, s.Run)
	defer func() { s.Close(context.Background()); stopped() }()
	select {
	case <-enough:
	case <-time.After(30 * time.Second):
		t.Fatal("the scheduler did not go round six times")
	}
	mu.Lock()
	got := append([]time.Duration(nil), waits[:passes]...)
	mu.Unlock()
	for i, d := range got {
		want := 10 * time.Millisecond << i // 10, 20, 40, 80, 160, 320 ms
		if d != want {
			t.Fatalf("waits while the due row is held: %v, want MinInterval doubling with each empty pass (pass %d: %v, want %v)", got, i, d, want)
		}
	}
	if st, _, _ := e.state(ev.ID); st != "armed" {
		t.Fatalf("the held reminder is %s, want armed", st)
	}
	holder.Commit()
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want one", due)
	}
}

// A scheduler stopped while its confirm is in flight lets the confirm finish (the claim's grace)
// instead of cutting the statement off: cut off, the server still commits it, and the re-read of
// an unknown outcome could run before that commit, confirm again behind its lock and count the
// signal this process emitted as lost.
func TestSchedulerStopDuringConfirmLetsItFinish(t *testing.T) {
	e := newEnv(t)
	blk := testenv.BlockClaims(t, e.pool, "buzz.reminders", "NEW.state = 'confirmed' AND OLD.state = 'claimed'")
	ev := e.store(time.Now().Unix() - 1)

	var logs testenv.LogBuf
	s := NewScheduler(Config{InstanceID: "stopping", DatabaseURL: e.url, Lease: time.Hour,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))}, e.pool)
	cancel, stopped := testenv.RunStoppable(t, s.Run) // its first batch claims the due reminder, confirm blocks
	blk.StopWhileBlocked(cancel, stopped)

	t.Log(logs.String())
	if strings.Contains(logs.String(), "outcome unknown") {
		t.Fatal("the stop cut the confirm off (its outcome became unknown)")
	}
	if st, rb, _ := e.state(ev.ID); st != "confirmed" || rb != 0 {
		t.Fatalf("after stopping mid-confirm: %s with %d rollbacks, want confirmed/0", st, rb)
	}
	if c, l := s.confirmed.Load(), s.lost.Load(); c != 1 || l != 0 {
		t.Fatalf("counted %d confirmed and %d lost, want 1 and 0", c, l)
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want one", due)
	}
}

// The LISTEN connection's reconnect backoff starts over after a connection that got as far as
// LISTEN: otherwise after a few blips over a long life every reconnect waits the full 5 s, and
// the notifications sent meanwhile are lost.
func TestSchedulerListenBackoffStartsOverAfterAHealthyConnection(t *testing.T) {
	// "Healthy" is a connection that lasted listenStable: zero here (every connection counts),
	// an hour in the second half (none does, so the waits grow).
	if got := listenWaits(t, 0); !slices.Equal(got, []time.Duration{100 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond}) {
		t.Fatalf("reconnect waits %v after connections that lasted long enough, want 100ms each", got)
	}
	if got := listenWaits(t, time.Hour); !slices.Equal(got, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond}) {
		t.Fatalf("reconnect waits %v after connections cut right after LISTEN, want them to double", got)
	}
}

// listenWaits cuts a scheduler's LISTEN connection three times, each once it is up, and returns
// the reconnect waits, with listenStable set to stable.
func listenWaits(t *testing.T, stable time.Duration) []time.Duration {
	e := newEnv(t)
	var waits waitLog
	s := NewScheduler(Config{InstanceID: "blips", DatabaseURL: e.url,
		Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	s.listenStable = stable
	s.onListenWait = waits.add
	_, stopped := testenv.RunStoppable(t, s.Run)
	defer func() { s.Close(context.Background()); stopped() }()
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		testenv.WaitUntil(t, 10*time.Second, "LISTEN up", s.listening.Load)
		if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
			WHERE application_name = 'buzzpg-reminders:blips' AND datname = current_database()`); err != nil {
			t.Fatal(err)
		}
		testenv.WaitUntil(t, 10*time.Second, "the LISTEN connection seen lost", func() bool { return !s.listening.Load() })
	}
	testenv.WaitUntil(t, 10*time.Second, "LISTEN up again", s.listening.Load)
	return waits.all()
}

// waitLog records the waits a scheduler hook reports from the scheduler's goroutines.
type waitLog struct {
	mu    sync.Mutex
	waits []time.Duration
}

func (w *waitLog) add(d time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.waits = append(w.waits, d)
}

func (w *waitLog) all() []time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.waits)
}

// An empty claim while expired reminders are due is progress, not a skipped row: the claim cancels
// them (NIP-40) instead of returning them. After an outage a backlog of them must not make the
// loop back off, or the valid reminders behind it fire up to a second per batch late.
func TestSchedulerDoesNotBackOffWhileCancellingExpiredReminders(t *testing.T) {
	e := newEnv(t)
	now := time.Now().Unix()
	var expired []string
	for i := 0; i < 30; i++ {
		expired = append(expired, e.store(now-10).ID)
	}
	if _, err := e.pool.Exec(context.Background(), `UPDATE buzz.reminders SET expires_at = $2 WHERE id = ANY ($1)`, expired, now-1); err != nil {
		t.Fatal(err)
	}
	valid := e.store(now - 1) // due after the expired ones (claims take the oldest not_before first)

	var log waitLog
	s := NewScheduler(Config{InstanceID: "expired", DatabaseURL: e.url, BatchSize: 10,
		MinInterval: 10 * time.Millisecond, MaxSleep: time.Hour,
		Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	s.onWait = log.add
	_, stopped := testenv.RunStoppable(t, s.Run)
	defer func() { s.Close(context.Background()); stopped() }()
	e.waitState(valid.ID, "confirmed", 10*time.Second)
	for _, id := range expired {
		if st, _, _ := e.state(id); st != "cancelled" {
			t.Fatalf("expired reminder %s is %s, want cancelled", id, st)
		}
	}
	waits := log.all()
	for _, d := range waits {
		if d != s.cfg.MinInterval && d != s.cfg.MaxSleep {
			t.Fatalf("waits %v: backed off (%v) while claims were cancelling expired reminders", waits, d)
		}
	}
}
