package reminders

// In-process tests of the reminder Scheduler against real PostgreSQL. Each test runs on a
// database of its own (FreshDB): schedulers claim every due reminder they can see.

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

type env struct {
	t    testing.TB
	url  string
	pool *pgxpool.Pool
	sk   string
	slot string
}

// newEnv: a fresh database with a test_decoding slot that shows every due message emitted.
func newEnv(t testing.TB) *env {
	u := testenv.FreshDB(t)
	e := &env{t: t, url: u, pool: testenv.Pool(t, u)}
	e.sk, _ = testenv.NewKey()
	e.slot = fmt.Sprintf("remsched_%d", time.Now().UnixNano()%1e12)
	if _, err := e.pool.Exec(context.Background(), `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, e.slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, e.slot) })
	return e
}

// onConfirm injects a fault into reminder confirms: a BEFORE UPDATE trigger named name runs body
// (PL/pgSQL statements) for every row an UPDATE turns 'confirmed'. setup runs first (a knob row,
// a counter), both in one statement batch.
func (e *env) onConfirm(name, setup, body string) {
	e.t.Helper()
	_, err := e.pool.Exec(context.Background(), setup+`;
		CREATE FUNCTION buzz.`+name+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF NEW.state = 'confirmed' THEN `+body+`
		  END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER `+name+` BEFORE UPDATE ON buzz.reminders
		  FOR EACH ROW EXECUTE FUNCTION buzz.`+name+`();`)
	if err != nil {
		e.t.Fatal(err)
	}
}

var storeMu sync.Mutex
var storeN int

// store accepts a 30300 with the given not_before through buzz.accept_event.
func (e *env) store(nb int64) *nostr.Event {
	e.t.Helper()
	storeMu.Lock()
	storeN++
	d := fmt.Sprint("r", storeN)
	storeMu.Unlock()
	ev := &nostr.Event{Kind: 30300, CreatedAt: nostr.Now(), Content: "enc:" + d,
		Tags: nostr.Tags{{"d", d}, {"not_before", fmt.Sprint(nb)}}}
	if err := ev.Sign(e.sk); err != nil {
		e.t.Fatal(err)
	}
	raw, _ := json.Marshal(ev)
	var ok bool
	var msg string
	if err := e.pool.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg); err != nil || !ok {
		e.t.Fatalf("accept: %v %q", err, msg)
	}
	return ev
}

// dueStamps consumes the slot: event id -> stamps of the due messages emitted for it.
func (e *env) dueStamps() map[string][]int64 {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, e.slot)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string][]int64{}
	for rows.Next() {
		var data string
		if err := rows.Scan(&data); err != nil {
			e.t.Fatal(err)
		}
		sigs, err := testenv.DueSignals(data)
		if err != nil {
			e.t.Fatal(err)
		}
		for _, sig := range sigs {
			out[sig.ID()] = append(out[sig.ID()], sig.Stamp)
		}
	}
	if err := rows.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}

func (e *env) state(id string) (state string, rollbacks, recoveries int) {
	e.t.Helper()
	if err := e.pool.QueryRow(context.Background(), `SELECT state, rollbacks, recoveries FROM buzz.reminders WHERE id = $1`, id).
		Scan(&state, &rollbacks, &recoveries); err != nil {
		e.t.Fatal(err)
	}
	return
}

func (e *env) waitState(id, want string, timeout time.Duration) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		st, _, _ := e.state(id)
		if st == want {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("reminder %s is %s after %s, want %s", id, st, timeout, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type schedKey struct{}

// start runs a scheduler whose Run context carries name (hooks can tell schedulers apart).
func (e *env) start(name string, cfg Config) *Scheduler {
	e.t.Helper()
	cfg.InstanceID = name
	cfg.DatabaseURL = e.url
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(e.t, slog.LevelDebug, nil)
	}
	s := NewScheduler(cfg, e.pool)
	ctx := context.WithValue(context.Background(), schedKey{}, name)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	e.t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = s.Close(cctx)
		<-done
	})
	deadline := time.Now().Add(10 * time.Second)
	for !s.listening.Load() {
		if time.Now().After(deadline) {
			e.t.Fatal("scheduler LISTEN connection not up")
		}
		time.Sleep(time.Millisecond)
	}
	return s
}

// The scheduler sleeps until not_before (not a fixed tick: MaxSleep is a minute), is woken by
// NOTIFY when an earlier reminder is stored, and emits once per version.
func TestSchedulerSleepsUntilNotBeforeAndEmitsOnce(t *testing.T) {
	e := newEnv(t)
	far := e.store(time.Now().Unix() + 3000)
	s := e.start("s1", Config{MaxSleep: time.Minute})
	// Stored while the scheduler sleeps towards `far`: NOTIFY must wake it for this one.
	nb := time.Now().Unix() + 2
	ev := e.store(nb)
	e.waitState(ev.ID, "confirmed", 30*time.Second)
	var late time.Duration
	if err := e.pool.QueryRow(context.Background(), `SELECT confirmed_at - to_timestamp(not_before) FROM buzz.reminders WHERE id = $1`, ev.ID).Scan(&late); err != nil {
		t.Fatal(err)
	}
	// Without the NOTIFY wake-up the scheduler would sleep on towards `far` until MaxSleep (a
	// minute) ends its sleep, almost a minute late; the bound leaves room for a loaded CI machine
	// and still tells the two apart.
	if late < 0 || late > 20*time.Second {
		t.Fatalf("confirmed %s after not_before, want within [0, 20s]", late)
	}
	past := e.store(time.Now().Unix() - 60) // already due: emitted at once
	e.waitState(past.ID, "confirmed", 5*time.Second)
	due := e.dueStamps()
	if len(due[ev.ID]) != 1 || len(due[past.ID]) != 1 || len(due[far.ID]) != 0 {
		t.Fatalf("due messages %v, want one each for %s and %s", due, ev.ID, past.ID)
	}
	if st, _, _ := e.state(far.ID); st != "armed" {
		t.Fatalf("far reminder %s", st)
	}
	s.wantConfirmed(t, 2)
}

// wantConfirmed waits until the scheduler has counted n confirms, and fails on more. Rows are
// confirmed once the commit is in; the scheduler counts them once its call returns.
func (s *Scheduler) wantConfirmed(t *testing.T, n int64) {
	t.Helper()
	testenv.WaitUntil(t, 10*time.Second, "the scheduler counting its confirms", func() bool { return s.confirmed.Load() >= n })
	if got := s.confirmed.Load(); got != n {
		t.Fatalf("scheduler confirmed %d, want %d", got, n)
	}
}

// A confirm the database refuses (an ERROR: nothing committed) is rolled back with the stamp;
// the reminder is then delivered once the fault is gone.
func TestSchedulerRollsBackWhenConfirmFails(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.onConfirm("test_fail_confirm", `INSERT INTO buzz.config VALUES ('test_fail_confirm', '1')`,
		`IF buzz.cfg('test_fail_confirm') = '1' THEN RAISE EXCEPTION 'injected confirm failure'; END IF;`)
	ev := e.store(time.Now().Unix() - 1)
	s := e.start("s1", Config{})
	deadline := time.Now().Add(10 * time.Second)
	for s.rolled.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if _, err := e.pool.Exec(ctx, `UPDATE buzz.config SET value = '0' WHERE key = 'test_fail_confirm'`); err != nil {
		t.Fatal(err)
	}
	if s.rolled.Load() == 0 {
		t.Fatal("no rollback after a failed confirm")
	}
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if _, rb, _ := e.state(ev.ID); rb < 1 {
		t.Fatalf("rollbacks %d", rb)
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want exactly one", due)
	}
}

// The confirm's backend is killed mid-statement (connection lost, outcome unknown to the
// scheduler): it re-reads by stamp rather than rolling back, finds its claim still standing,
// confirms again, and the signal is emitted once.
func TestSchedulerUnknownOutcomeRereadsByStamp(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.onConfirm("test_stall_confirm", `INSERT INTO buzz.config VALUES ('test_stall_confirm', '1')`,
		`IF buzz.cfg('test_stall_confirm') = '1' THEN PERFORM pg_sleep(60); END IF;`)
	ev := e.store(time.Now().Unix() - 1)
	s := e.start("s1", Config{})
	var pid int
	deadline := time.Now().Add(10 * time.Second)
	for pid == 0 && time.Now().Before(deadline) {
		_ = e.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
			AND query LIKE '%confirm_reminder_claims%' AND wait_event = 'PgSleep'`).Scan(&pid)
		time.Sleep(2 * time.Millisecond)
	}
	if pid == 0 {
		t.Fatal("confirm never stalled")
	}
	if _, err := e.pool.Exec(ctx, `UPDATE buzz.config SET value = '0' WHERE key = 'test_stall_confirm'`); err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if _, rb, _ := e.state(ev.ID); rb != 0 {
		t.Fatalf("rolled back %d times after an unknown outcome; want a re-read, not a rollback", rb)
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want exactly one", due)
	}
	s.wantConfirmed(t, 1)
}

// The commit happened but the scheduler did not hear back: the re-read sees the row confirmed
// under its stamp and neither rolls back nor emits again.
func TestSchedulerResolveUnknownCommitted(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	ev := e.store(time.Now().Unix() - 1)
	s := NewScheduler(Config{InstanceID: "x", Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	var stamp int64
	if err := e.pool.QueryRow(ctx, `SELECT stamp FROM buzz.claim_due_reminders(10, '1 minute', false)`).Scan(&stamp); err != nil {
		t.Fatal(err)
	}
	s.inflight[ev.ID] = stamp
	if _, err := e.pool.Exec(ctx, `SELECT buzz.confirm_reminder_claims($1, $2)`, []string{ev.ID}, []int64{stamp}); err != nil {
		t.Fatal(err)
	}
	s.resolveUnknown(ctx, []claim{{id: ev.ID, notBefore: int64(ev.CreatedAt), stamp: stamp}}, time.Now().Add(time.Minute))
	if s.confirmed.Load() != 1 || s.rolled.Load() != 0 || len(s.inflight) != 0 {
		t.Fatalf("confirmed %d rolled %d inflight %v", s.confirmed.Load(), s.rolled.Load(), s.inflight)
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want exactly one", due)
	}
}

// Graceful Close between claim and confirm rolls the claims back (stamp-guarded), so another
// process delivers them at once instead of after the lease.
func TestSchedulerCloseRollsBackOwnClaims(t *testing.T) {
	e := newEnv(t)
	reached, undo := holdAfterClaim("closing", nil) // held there until Close cancels the scheduler
	defer undo()
	evs := []*nostr.Event{e.store(time.Now().Unix() - 1), e.store(time.Now().Unix() - 1)}
	s := e.start("closing", Config{Lease: time.Hour})
	<-reached
	cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Close(cctx); err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if st, rb, _ := e.state(ev.ID); st != "armed" || rb != 1 {
			t.Fatalf("%s after Close: %s with %d rollbacks, want armed/1", ev.ID, st, rb)
		}
	}
	// Another scheduler picks them up right away (well before the hour-long lease).
	e.start("other", Config{})
	for _, ev := range evs {
		e.waitState(ev.ID, "confirmed", 10*time.Second)
	}
	due := e.dueStamps()
	for _, ev := range evs {
		if len(due[ev.ID]) != 1 {
			t.Fatalf("due messages %v", due)
		}
	}
}

// A scheduler that stalls after claiming (as if dead) loses its claim to another one after the
// lease; when it comes back its confirm is fenced out by the new stamp: one emission in all.
func TestSchedulerRecoversStalledClaimOnce(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	reached, undo := holdAfterClaim("stalled", release)
	defer undo()
	ev := e.store(time.Now().Unix() - 1)
	stalled := e.start("stalled", Config{Lease: 300 * time.Millisecond})
	<-reached
	if st, _, _ := e.state(ev.ID); st != "claimed" {
		t.Fatalf("state %s, want claimed", st)
	}
	rescuer := e.start("rescuer", Config{Lease: time.Minute})
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if _, _, rec := e.state(ev.ID); rec != 1 {
		t.Fatalf("recoveries %d, want 1", rec)
	}
	close(release)
	deadline := time.Now().Add(10 * time.Second)
	for (stalled.lost.Load() == 0 || rescuer.confirmed.Load() == 0) && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	if stalled.lost.Load() != 1 || stalled.confirmed.Load() != 0 || rescuer.confirmed.Load() != 1 {
		t.Fatalf("stalled lost %d confirmed %d; rescuer confirmed %d", stalled.lost.Load(), stalled.confirmed.Load(), rescuer.confirmed.Load())
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v, want exactly one", due)
	}
}

// Every confirm loses its connection before answering (the trigger terminates its own backend):
// the outcome stays unknown however often the scheduler re-reads and confirms again. The
// resolution ends once the lease from the first unknown outcome has passed, leaving the claim to
// lease recovery, instead of starting a fresh lease on every attempt and never ending.
func TestSchedulerUnknownOutcomesEndAfterOneLease(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.onConfirm("test_kill_confirm", `CREATE SEQUENCE buzz.test_confirm_attempts`, `
		PERFORM nextval('buzz.test_confirm_attempts'); -- not transactional: counts every attempt
		PERFORM pg_terminate_backend(pg_backend_pid());
		PERFORM pg_sleep(5); -- the termination interrupts this`)
	ev := e.store(time.Now().Unix() - 1)
	const lease = 3 * time.Second // each confirm attempt needs a new connection within it
	s := NewScheduler(Config{InstanceID: "x", Lease: lease, Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	var stamp int64
	if err := e.pool.QueryRow(ctx, `SELECT stamp FROM buzz.claim_due_reminders(10, '1 minute', false)`).Scan(&stamp); err != nil {
		t.Fatal(err)
	}
	s.inflight[ev.ID] = stamp
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		done <- s.confirmBatch(ctx, []claim{{id: ev.ID, notBefore: int64(ev.CreatedAt), stamp: stamp}})
	}()
	select {
	case <-done:
	case <-time.After(10 * lease):
		t.Fatal("the scheduler kept resolving an unknown outcome long past one lease")
	}
	took := time.Since(start)
	var attempts int64
	if err := e.pool.QueryRow(ctx, `SELECT last_value FROM buzz.test_confirm_attempts`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts < 2 {
		t.Fatalf("%d confirm attempts: the unknown outcome was not re-confirmed", attempts)
	}
	if st, rb, _ := e.state(ev.ID); st != "claimed" || rb != 0 {
		t.Fatalf("after giving up: state %s, %d rollbacks; want the claim left to lease recovery", st, rb)
	}
	if due := e.dueStamps(); len(due[ev.ID]) != 0 {
		t.Fatalf("due messages %v, want none", due)
	}
	t.Logf("gave up after %s and %d confirm attempts", took.Round(time.Millisecond), attempts)
}

// The scheduler's LISTEN connection is killed: a reminder stored while it is away (its NOTIFY
// reaches nobody) is found by the nudge on reconnect, and one stored after the reconnect by its
// NOTIFY. MaxSleep is an hour and an earlier-armed reminder is far away, so without either the
// scheduler would sleep on.
func TestSchedulerListenReconnects(t *testing.T) {
	e := newEnv(t)
	e.store(time.Now().Unix() + 3000)
	s := e.start("s1", Config{MaxSleep: time.Hour})
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = 'buzzpg-reminders:s1' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 10*time.Second, "the LISTEN connection seen lost", func() bool { return !s.listening.Load() })
	away := e.store(time.Now().Unix()) // due now; the reconnect waits at least 100 ms
	e.waitState(away.ID, "confirmed", 20*time.Second)
	testenv.WaitUntil(t, 10*time.Second, "LISTEN again", s.listening.Load)
	after := e.store(time.Now().Unix() + 1)
	e.waitState(after.ID, "confirmed", 20*time.Second)
}

// docs/design.md: bursts use the batch forms. 250 reminders already due when the scheduler starts are
// claimed and confirmed at least 100 to a transaction (here all in one claim of BatchSize), and
// their due signals travel 100 to a logical message: the test_decoding slot shows how many
// transactions and messages carried them.
func TestSchedulerBurstUsesBatches(t *testing.T) {
	const n = 250
	e := newEnv(t)
	past := time.Now().Unix() - 60
	for range n {
		e.store(past)
	}
	s := e.start("s1", Config{MaxSleep: time.Minute})
	testenv.WaitUntil(t, 60*time.Second, "every reminder confirmed", func() bool { return s.confirmed.Load() == n })

	rows, err := e.pool.Query(context.Background(), `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, e.slot)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	txns, messages, signals, inTxn := 0, 0, 0, 0
	for rows.Next() {
		var data string
		if err := rows.Scan(&data); err != nil {
			t.Fatal(err)
		}
		switch {
		case strings.HasPrefix(data, "BEGIN"):
			inTxn = 0
		case strings.HasPrefix(data, "COMMIT"):
			if inTxn > 0 {
				txns++
			}
		default:
			sigs, err := testenv.DueSignals(data)
			if err != nil {
				t.Fatal(err)
			}
			if len(sigs) > 0 {
				messages++
				signals += len(sigs)
				inTxn += len(sigs)
				if len(sigs) > 100 {
					t.Fatalf("a message of %d due signals, want at most 100", len(sigs))
				}
			}
		}
	}
	if signals != n {
		t.Fatalf("%d due signals for %d reminders", signals, n)
	}
	if txns > (n+99)/100 || messages > (n+99)/100+txns {
		t.Fatalf("%d reminders confirmed in %d transactions and %d messages; a burst must go at least 100 to a transaction and to a message", n, txns, messages)
	}
}

// holdAfterClaim holds the scheduler started as name right after each claim, until release is
// closed or the scheduler stops (a nil release: until it stops). reached receives a signal when
// it is held; undo removes the hook.
func holdAfterClaim(name string, release <-chan struct{}) (reached <-chan struct{}, undo func()) {
	r := make(chan struct{}, 1)
	undo = hooks.Set("reminder.after_claim", func(ctx context.Context) {
		if ctx.Value(schedKey{}) != name {
			return
		}
		select {
		case r <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-ctx.Done():
		}
	})
	return r, undo
}
