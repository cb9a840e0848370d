package testenv

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ClaimBlock holds claim statements inside the server: a trigger on table waits for an advisory
// lock the test holds on its own connection whenever an UPDATE makes when true (BlockClaims: in
// the UPDATE; BlockClaimCommits: at its COMMIT). The test then knows the claim is in flight (not
// yet committed) and decides when it goes on.
type ClaimBlock struct {
	t     testing.TB
	pool  *pgxpool.Pool
	conn  *pgxpool.Conn
	table string
}

const claimBlockKey = 707070

func BlockClaims(t testing.TB, pool *pgxpool.Pool, table, when string) *ClaimBlock {
	t.Helper()
	return newClaimBlock(t, pool, table, `CREATE TRIGGER block_claims BEFORE UPDATE ON `+table+`
		  FOR EACH ROW EXECUTE FUNCTION public.block_claims();`, `
		  IF `+when+` THEN PERFORM pg_advisory_xact_lock(`+strconv.Itoa(claimBlockKey)+`); END IF;
		  RETURN NEW;`)
}

// BlockClaimCommits holds claim transactions at their COMMIT instead, after the statement has
// produced all its rows: a deferred constraint trigger raises a NOTICE first, which makes the
// server flush its output (the rows reach the client before the commit), then waits for the
// test's advisory lock. The test decides whether the claim then commits (release) or not (cancel
// the backend).
func BlockClaimCommits(t testing.TB, pool *pgxpool.Pool, table, when string) *ClaimBlock {
	t.Helper()
	return newClaimBlock(t, pool, table, `CREATE CONSTRAINT TRIGGER block_claims AFTER UPDATE ON `+table+`
		  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (`+when+`) EXECUTE FUNCTION public.block_claims();`, `
		  RAISE NOTICE 'test: claim about to commit';
		  PERFORM pg_advisory_xact_lock(`+strconv.Itoa(claimBlockKey)+`);
		  RETURN NULL;`)
}

func newClaimBlock(t testing.TB, pool *pgxpool.Pool, table, createTrigger, body string) *ClaimBlock {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	b := &ClaimBlock{t: t, pool: pool, conn: conn, table: table}
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, claimBlockKey); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.block_claims() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN`+body+`
		END $$;
		`+createTrigger); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Release(); b.Drop() })
	return b
}

// WaitBlocked returns the pid of the backend waiting in the trigger.
func (b *ClaimBlock) WaitBlocked() (pid int32) {
	b.t.Helper()
	WaitUntil(b.t, 10*time.Second, "a claim blocked in the trigger", func() bool {
		err := b.pool.QueryRow(context.Background(), `
			SELECT pid FROM pg_stat_activity
			 WHERE wait_event_type = 'Lock' AND wait_event = 'advisory' AND datname = current_database()
			 LIMIT 1`).Scan(&pid)
		return err == nil
	})
	return pid
}

// Release lets the blocked claim go on (and commit, unless its session is gone).
func (b *ClaimBlock) Release() {
	if b.conn == nil {
		return
	}
	_, _ = b.conn.Exec(context.Background(), `SELECT pg_advisory_unlock_all()`)
	b.conn.Release()
	b.conn = nil
}

// WaitDone waits until backend pid has finished its statement (committed or not). The pool may
// hand that very connection to this query once the claimer is done with it.
func (b *ClaimBlock) WaitDone(pid int32) {
	b.t.Helper()
	WaitUntil(b.t, 10*time.Second, "the blocked claim statement to end", func() bool {
		var active bool
		err := b.pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND pid <> pg_backend_pid())`, pid).Scan(&active)
		return err == nil && !active
	})
}

// Drop removes the trigger and its function.
func (b *ClaimBlock) Drop() {
	_, _ = b.pool.Exec(context.Background(),
		`DROP TRIGGER IF EXISTS block_claims ON `+b.table+`; DROP FUNCTION IF EXISTS public.block_claims()`)
}

// ReleaseLateCommit, when mode is BreakCommitsLater, lets the claim that outlived its cut
// connection go on once who (the runner that broke off) waits for it to end or has handled the
// break, and waits until the claim's statement ended. Other modes leave nothing to release.
func (b *ClaimBlock) ReleaseLateCommit(mode ClaimBreak, who string, handled func() bool) {
	if mode != BreakCommitsLater {
		return
	}
	b.t.Helper()
	pid := b.WaitBlocked()
	WaitUntil(b.t, 10*time.Second, who+" waiting for the claim to end, or past it", func() bool {
		return handled() || WaitingForRowLock(b.t, b.pool)
	})
	b.Release()
	b.WaitDone(pid)
}

// StopWhileBlocked stops a runner once its statement waits in the trigger: cancel stops it, the
// statement is let go on, stopped waits for the runner to end, then for the statement to end, and
// the trigger is dropped.
func (b *ClaimBlock) StopWhileBlocked(cancel, stopped func()) {
	b.t.Helper()
	pid := b.WaitBlocked()
	cancel()
	b.Release()
	stopped()
	b.WaitDone(pid)
	b.Drop()
}
