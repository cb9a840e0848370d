package store_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// retryEnv is a fresh database whose event inserts can be made to fail once: the trigger counts
// attempts in a sequence (not rolled back with the failed transaction), so the first attempt fails
// and every later one goes through.
type retryEnv struct {
	t    *testing.T
	url  string
	pool *pgxpool.Pool
}

func newRetryEnv(t *testing.T) *retryEnv {
	t.Helper()
	url := testenv.FreshDB(t)
	return &retryEnv{t: t, url: url, pool: testenv.Pool(t, url)}
}

func (e *retryEnv) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("exec %q: %v", sql, err)
	}
}

// attempts is how many times the trigger ran for the event (each run is one attempt's insert).
func (e *retryEnv) attempts() int64 {
	e.t.Helper()
	var n int64
	if err := e.pool.QueryRow(context.Background(),
		`SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.insert_attempts`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

func (e *retryEnv) stored(id string) bool {
	e.t.Helper()
	var n int
	_ = e.pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE id = $1`, id).Scan(&n)
	return n == 1
}

// failOnce makes the first insert of event id raise SQLSTATE code (as PostgreSQL does for a
// serialization failure under SERIALIZABLE/REPEATABLE READ); the second one passes.
func (e *retryEnv) failOnce(id, code string) {
	e.t.Helper()
	e.exec(`
		CREATE SEQUENCE public.insert_attempts;
		CREATE FUNCTION public.fail_once() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF nextval('public.insert_attempts') = 1 THEN
		    RAISE EXCEPTION USING ERRCODE = TG_ARGV[0], MESSAGE = 'test: provoked on the first attempt';
		  END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER fail_once BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.id = '` + id + `') EXECUTE FUNCTION public.fail_once('` + code + `');`)
}

// Go retries SQLSTATE 40001 (docs/design.md): an acceptance whose first attempt is rolled back with a
// serialization failure succeeds on the retry. Without the retry the same call fails.
func TestAcceptRetriesSerializationFailure(t *testing.T) {
	e := newRetryEnv(t)
	ctx := context.Background()
	u := testenv.NewUser()

	// Control: the provoked failure really reaches a caller that does not retry.
	control := u.Event(t, 1, nostr.Tags{{"t", "retry"}}, "control")
	e.failOnce(control.ID, "40001")
	raw, _ := json.Marshal(control)
	var ok bool
	var msg string
	err := e.pool.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg)
	if db.SQLState(err) != "40001" {
		t.Fatalf("control without retry: err %v (SQLSTATE %q), want 40001", err, db.SQLState(err))
	}
	if e.stored(control.ID) {
		t.Fatal("control: the failed attempt stored the event")
	}
	e.exec(`DROP TRIGGER fail_once ON buzz.events; DROP FUNCTION public.fail_once(); DROP SEQUENCE public.insert_attempts`)

	ev := u.Event(t, 1, nostr.Tags{{"t", "retry"}}, "retried")
	e.failOnce(ev.ID, "40001")
	ok, msg, err = store.Accept(ctx, e.pool, ev)
	if err != nil || !ok {
		t.Fatalf("store.Accept with one serialization failure: ok=%v %q err=%v (want accepted on retry)", ok, msg, err)
	}
	if n := e.attempts(); n != 2 {
		t.Fatalf("insert attempts %d, want 2 (one failed, one retried)", n)
	}
	if !e.stored(ev.ID) {
		t.Fatal("event not stored after the retry")
	}
}

// Go retries SQLSTATE 40P01: a real deadlock between acceptance's first attempt and another
// transaction, with acceptance chosen as the victim, ends with the event accepted on the retry.
//
// Steps (barriers on pg_stat_activity, no sleeps): the accept's trigger (first attempt only)
// takes advisory lock A, then waits for gate G held by T. S takes B and waits for A. T lets the
// trigger go on; it asks for B, held by S: a cycle. S runs with a long deadlock_timeout, the
// trigger with a short one, so the accept's backend detects the deadlock and is aborted.
func TestAcceptRetriesDeadlock(t *testing.T) {
	e := newRetryEnv(t)
	ctx := context.Background()
	const lockA, lockB, gateG = 91001, 91002, 91003
	u := testenv.NewUser()
	ev := u.Event(t, 1, nostr.Tags{{"t", "deadlock"}}, "deadlock victim")
	e.exec(`
		CREATE SEQUENCE public.insert_attempts;
		CREATE FUNCTION public.deadlock_once() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF nextval('public.insert_attempts') = 1 THEN
		    SET LOCAL deadlock_timeout = '10ms';
		    PERFORM pg_advisory_xact_lock(91001);
		    PERFORM pg_advisory_xact_lock_shared(91003);  -- the test's gate
		    PERFORM pg_advisory_xact_lock(91002);
		  END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER deadlock_once BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.id = '` + ev.ID + `') EXECUTE FUNCTION public.deadlock_once();`)

	gate := testenv.NewSession(t, e.url, "gate")
	if _, err := gate.Conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, gateG); err != nil {
		t.Fatal(err)
	}
	s := testenv.NewSession(t, e.url, "partner")
	if _, err := s.Conn.Exec(ctx, `SET deadlock_timeout = '1h'`); err != nil {
		t.Fatal(err)
	}
	s.Begin()
	if _, err := s.Tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lockB); err != nil {
		t.Fatal(err)
	}

	var ok bool
	var msg string
	var accErr error
	accepted := testenv.Async(func() { ok, msg, accErr = store.Accept(ctx, e.pool, ev) })
	// The accept's first attempt holds A and waits at the gate.
	testenv.WaitUntil(t, 20*time.Second, "the accept waiting at the gate", func() bool {
		var n int
		_ = e.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND objid = $1 AND NOT granted`, gateG).Scan(&n)
		return n == 1
	})
	// S asks for A and waits (never detecting: its deadlock_timeout is an hour).
	var sErr error
	sDone := testenv.Async(func() { _, sErr = s.Tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, lockA) })
	if !testenv.WaitBlockedOrDone(t, e.pool, s.PID, sDone) {
		t.Fatalf("partner got lock A while the accept should hold it: %v", sErr)
	}
	// Open the gate: the accept asks for B and closes the cycle.
	if _, err := gate.Conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, gateG); err != nil {
		t.Fatal(err)
	}
	<-sDone // the victim's locks are gone, so S got A
	if sErr != nil {
		t.Fatalf("partner was the deadlock victim (%v); the test wants the accept to be", sErr)
	}
	<-accepted
	if err := s.Tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if accErr != nil || !ok {
		t.Fatalf("store.Accept after a deadlock: ok=%v %q err=%v (SQLSTATE %q), want accepted on retry",
			ok, msg, accErr, db.SQLState(accErr))
	}
	if n := e.attempts(); n != 2 {
		t.Fatalf("insert attempts %d, want 2 (the deadlocked one and the retry)", n)
	}
	if !e.stored(ev.ID) {
		t.Fatal("event not stored after the retry")
	}
}
