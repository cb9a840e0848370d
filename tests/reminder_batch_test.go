package tests

// Guards of the batch reminder functions the scheduler calls (listener/reminder.go uses only
// these): buzz.claim_due_reminders and buzz.rollback_reminder_claims (sql/0004_reminders.up.sql).
// The batch confirm's stamp guard is covered by TestReminderStaleConfirmEmitsNothing.
//
// Each test runs on a FreshDB: a batch claim takes every due row of its database.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// remBatchClaim is one row of buzz.claim_due_reminders.
type remBatchClaim struct {
	ID        string
	Stamp     int64
	Recovered bool
}

func remClaimBatch(ctx context.Context, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, max int, lease time.Duration) ([]remBatchClaim, error) {
	rows, err := q.Query(ctx, `SELECT id, stamp, recovered FROM buzz.claim_due_reminders($1, $2, false)`, max, lease)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[remBatchClaim])
}

func remMustClaimBatch(t testing.TB, pool *pgxpool.Pool, max int, lease time.Duration) []remBatchClaim {
	t.Helper()
	got, err := remClaimBatch(context.Background(), pool, max, lease)
	if err != nil {
		t.Fatalf("claim_due_reminders(%d, %s): %v", max, lease, err)
	}
	return got
}

// Guard: FOR UPDATE SKIP LOCKED in both CTEs of claim_due_reminders (expired leases and armed
// rows). Without the row locks a second scheduler re-claims rows the first one holds (two stamps
// for one row, the due signal sent twice); without SKIP LOCKED it queues behind the first one
// instead of taking the rest (docs/design.md, Data flow, step 3), and only the re-check of the locked rows'
// state keeps the sets disjoint.
//
// Interleaving: claimer 1 locks its rows, then pauses inside its UPDATE (a BEFORE UPDATE trigger
// waits on an advisory lock the test holds, for claimer 1's application_name only). Claimer 2 runs
// meanwhile: it must finish without waiting, with exactly the rows claimer 1 did not lock. After
// the release every row is claimed exactly once, under the stamp of the claimer that returned it.
func TestReminderBatchClaimSkipsRowsLockedByAnotherClaimer(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()

	// Six due reminders, oldest first; the two oldest get an expired lease (a claimer that died).
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	var all []string
	for i := range 6 {
		ev := remEvent(t, sk, now, fmt.Sprint("batch-", i), remNB(now-10+int64(i)))
		remMustAccept(t, pool, ev)
		all = append(all, ev.ID)
	}
	dead := remMustClaimBatch(t, pool, 2, time.Millisecond)
	if len(dead) != 2 || dead[0].ID != all[0] || dead[1].ID != all[1] {
		t.Fatalf("setup claim took %+v, want the two oldest", dead)
	}
	remWaitLeaseExpired(t, pool, all[0])
	remWaitLeaseExpired(t, pool, all[1])
	claimsBefore := map[string]int{}
	for _, id := range all {
		claimsBefore[id] = remGet(t, pool, id).Claims
	}

	const lockKey = 7301
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.pause_claimer_1() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF current_setting('application_name') = 'buzzpg-test-claimer-1' THEN
		    PERFORM pg_advisory_xact_lock_shared(`+fmt.Sprint(lockKey)+`);
		  END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER pause_claimer_1 BEFORE UPDATE ON buzz.reminders
		  FOR EACH ROW EXECUTE FUNCTION public.pause_claimer_1();`); err != nil {
		t.Fatal(err)
	}
	gate := testenv.NewSession(t, url, "gate")
	if _, err := gate.Conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			if _, err := gate.Conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, lockKey); err != nil {
				t.Error(err)
			}
		}
	}
	defer release()

	// Claimer 1 takes the two expired leases and the oldest armed row, and pauses holding them.
	c1 := testenv.NewSession(t, url, "claimer-1")
	var got1 []remBatchClaim
	var err1 error
	done1 := testenv.Async(func() { got1, err1 = remClaimBatch(ctx, c1.Conn, 3, 10*time.Minute) })
	if !testenv.WaitBlockedOrDone(t, pool, c1.PID, done1) {
		t.Fatalf("claimer 1 finished without pausing in the trigger: %+v %v", got1, err1)
	}

	// Claimer 2 asks for more than is left while claimer 1 holds its rows.
	c2 := testenv.NewSession(t, url, "claimer-2")
	var got2 []remBatchClaim
	var err2 error
	done2 := testenv.Async(func() { got2, err2 = remClaimBatch(ctx, c2.Conn, 10, 10*time.Minute) })
	c2Waited := testenv.WaitBlockedOrDone(t, pool, c2.PID, done2)

	release()
	<-done1
	<-done2
	if err1 != nil || err2 != nil {
		t.Fatalf("claimer 1: %v, claimer 2: %v", err1, err2)
	}

	// Every row claimed exactly once, by one claimer, under that claimer's stamp.
	by := map[string]string{}
	for name, got := range map[string][]remBatchClaim{"claimer 1": got1, "claimer 2": got2} {
		for _, c := range got {
			if other, dup := by[c.ID]; dup {
				t.Errorf("row %.8s claimed by %s and by %s", c.ID, other, name)
			}
			by[c.ID] = name
			r := remGet(t, pool, c.ID)
			if r.State != "claimed" || r.Stamp == nil || *r.Stamp != c.Stamp || r.Claims != claimsBefore[c.ID]+1 {
				t.Errorf("row %.8s, returned to %s with stamp %d: %s, want claimed under that stamp with claims %d",
					c.ID, name, c.Stamp, remShow(r), claimsBefore[c.ID]+1)
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	ids1, ids2 := remIDs(got1), remIDs(got2)
	if want := []string{all[0], all[1], all[2]}; !slices.Equal(ids1, want) || !got1[0].Recovered || !got1[1].Recovered || got1[2].Recovered {
		t.Fatalf("claimer 1 took %+v, want the two expired leases (recovered) and the oldest armed row %.8s", got1, all[2])
	}
	if want := all[3:]; !slices.Equal(ids2, want) {
		t.Fatalf("claimer 2 took %.8v, want the three rows claimer 1 did not lock %.8v", ids2, want)
	}
	if c2Waited {
		t.Fatal("claimer 2 waited for claimer 1's row locks instead of skipping them (SKIP LOCKED)")
	}
	// I5: six claims, six stamps, and the two recoveries do not reuse the dead claimer's stamps.
	remAssertDistinctStamps(t, "claims of claimers 1 and 2", remStamps(got1), remStamps(got2))
	remAssertDistinctStamps(t, "the dead claims and their recoveries", remStamps(dead), remStamps(got1[:2]))
	if again := remMustClaimBatch(t, pool, 10, 10*time.Minute); len(again) != 0 {
		t.Fatalf("a third claim took %+v while every row is held", again)
	}
}

// Guard: `x.stamp = u.stamp` in rollback_reminder_claims. A scheduler whose lease expired and was
// recovered by another one must not undo the new owner's claim: the row would go back to armed and
// be claimed and signalled a second time. A stale pair changes nothing, even beside a current
// pair in the same batch, which is rolled back.
func TestReminderBatchRollbackStaleStampChangesNothing(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	recovered := remDue(t, pool)
	first := remMustClaimBatch(t, pool, 10, 20*time.Millisecond)
	if len(first) != 1 || first[0].ID != recovered.ID {
		t.Fatalf("first claim: %+v", first)
	}
	s1 := first[0].Stamp
	remWaitLeaseExpired(t, pool, recovered.ID)

	plain := remDue(t, pool)
	second := remMustClaimBatch(t, pool, 10, 10*time.Minute)
	stamps := map[string]remBatchClaim{}
	for _, c := range second {
		stamps[c.ID] = c
	}
	s2 := stamps[recovered.ID]
	if len(second) != 2 || !s2.Recovered || s2.Stamp == s1 || stamps[plain.ID].Stamp == 0 {
		t.Fatalf("recovery claim: %+v, want %.8s recovered with a new stamp and %.8s claimed", second, recovered.ID, plain.ID)
	}
	remAssertDistinctStamps(t, "first claim and the recovery batch", []int64{s1}, remStamps(second))
	before := remGet(t, pool, recovered.ID)

	var rolled []string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(x), '{}') FROM buzz.rollback_reminder_claims($1, $2) x`,
		[]string{recovered.ID, plain.ID}, []int64{s1, stamps[plain.ID].Stamp}).Scan(&rolled); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(rolled, []string{plain.ID}) {
		t.Fatalf("rollback_reminder_claims rolled back %.8v, want only the current pair %.8s (the stale stamp %d of %.8s must change nothing)",
			rolled, plain.ID, s1, recovered.ID)
	}
	after := remGet(t, pool, recovered.ID)
	if after.State != "claimed" || after.Stamp == nil || *after.Stamp != s2.Stamp || after.Rolls != before.Rolls {
		t.Fatalf("stale rollback changed the row: %s -> %s, want still claimed under %d",
			remShow(before), remShow(after), s2.Stamp)
	}
	if r := remGet(t, pool, plain.ID); r.State != "armed" || r.Rolls != 1 {
		t.Fatalf("current pair after rollback: %s, want armed with one rollback", remShow(r))
	}
}

func remStamps(cs []remBatchClaim) []int64 {
	out := make([]int64, len(cs))
	for i, c := range cs {
		out[i] = c.Stamp
	}
	return out
}

func remIDs(cs []remBatchClaim) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.ID
	}
	return out
}

func remShow(r remRow) string {
	stamp := "NULL"
	if r.Stamp != nil {
		stamp = fmt.Sprint(*r.Stamp)
	}
	return fmt.Sprintf("state %s stamp %s claims %d recoveries %d rollbacks %d", r.State, stamp, r.Claims, r.Recoveries, r.Rolls)
}
