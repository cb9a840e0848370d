package tests

// Invariants I5 and I6 at the SQL boundary (sql/0004_reminders.up.sql), against real PostgreSQL.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Two claims on two connections, released together by a barrier on database state: a third
// session holds the row lock until both claimers are observed waiting for it, so both statements
// really run concurrently and the loser goes through the re-check. Exactly one gets a stamp.
func TestReminderConcurrentClaimsExactlyOneWins(t *testing.T) {
	url := testenv.DB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	for round := 0; round < 20; round++ {
		ev := remDue(t, pool)
		holder := testenv.NewSession(t, url, "rem-holder")
		holder.Begin()
		if _, err := holder.Tx.Exec(ctx, `SELECT 1 FROM buzz.reminders WHERE id = $1 FOR UPDATE`, ev.ID); err != nil {
			t.Fatal(err)
		}
		a, b := testenv.NewSession(t, url, "rem-a"), testenv.NewSession(t, url, "rem-b")
		var stamps [2]*int64
		var errs [2]error
		var wg sync.WaitGroup
		dones := make([]<-chan struct{}, 2)
		for i, s := range []*testenv.Session{a, b} {
			i, s := i, s
			wg.Add(1)
			// Not remClaim: its t.Fatalf must not run outside the test's goroutine.
			dones[i] = testenv.Async(func() { defer wg.Done(); stamps[i], errs[i] = remClaimErr(s.Conn, ev) })
		}
		for i, s := range []*testenv.Session{a, b} {
			if !testenv.WaitBlockedOrDone(t, pool, s.PID, dones[i]) {
				t.Fatalf("round %d: claimer %d did not block behind the row lock", round, i)
			}
		}
		if err := holder.Tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d: claimer %d: %v", round, i, err)
			}
		}
		won := 0
		for _, s := range stamps {
			if s != nil {
				won++
			}
		}
		if won != 1 {
			t.Fatalf("round %d: %d of 2 concurrent claims won (stamps %s), want exactly 1", round, won, remFmt(stamps[:]))
		}
		if third := remClaim(t, pool, ev); third != nil {
			t.Fatalf("round %d: a third claim got stamp %d while the claim is held", round, *third)
		}
		if r := remGet(t, pool, ev.ID); r.State != "claimed" || r.Claims != 1 {
			t.Fatalf("round %d: row %+v, want claimed once", round, r)
		}
		a.Conn.Close(ctx)
		b.Conn.Close(ctx)
		holder.Conn.Close(ctx)
	}
}

func TestReminderRollbackMatchingStampThenNewClaimWins(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	ev := remDue(t, pool)
	s1 := remClaim(t, pool, ev)
	if s1 == nil {
		t.Fatal("first claim got NULL")
	}
	if !remBoolCall(t, pool, "rollback_reminder_claim", ev, *s1) {
		t.Fatal("rollback with the matching stamp returned false")
	}
	if r := remGet(t, pool, ev.ID); r.State != "armed" || r.Rolls != 1 {
		t.Fatalf("after rollback: %+v, want armed with one rollback", r)
	}
	s2 := remClaim(t, pool, ev)
	if s2 == nil || *s2 == *s1 {
		t.Fatalf("claim after rollback: %v (first %d), want a new stamp", s2, *s1)
	}
}

// The row holds a newer claim (the old one's lease expired and was re-taken): the old owner's
// rollback is refused and changes nothing.
func TestReminderRollbackStaleStampChangesNothing(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	ev := remDue(t, pool)
	s1 := remClaimLease(t, pool, ev, 20*time.Millisecond)
	if s1 == nil {
		t.Fatal("first claim got NULL")
	}
	remWaitLeaseExpired(t, pool, ev.ID)
	s2 := remClaim(t, pool, ev)
	if s2 == nil || *s2 == *s1 {
		t.Fatalf("recovery claim: %v, want a new stamp", s2)
	}
	before := remGet(t, pool, ev.ID)
	if before.Recoveries != 1 {
		t.Fatalf("recoveries %d, want 1", before.Recoveries)
	}
	if remBoolCall(t, pool, "rollback_reminder_claim", ev, *s1) {
		t.Fatal("rollback with a stale stamp returned true")
	}
	after := remGet(t, pool, ev.ID)
	if after.State != "claimed" || after.Stamp == nil || *after.Stamp != *s2 || after.Rolls != 0 {
		t.Fatalf("stale rollback changed the row: %+v -> %+v", before, after)
	}
	// And the stale owner cannot confirm either (nothing emitted: see the slot test).
	if remBoolCall(t, pool, "confirm_reminder_claim", ev, *s1) {
		t.Fatal("confirm with a stale stamp returned true")
	}
	if !remBoolCall(t, pool, "confirm_reminder_claim", ev, *s2) {
		t.Fatal("confirm with the current stamp returned false")
	}
	if remBoolCall(t, pool, "rollback_reminder_claim", ev, *s2) {
		t.Fatal("rollback after confirm returned true")
	}
	if r := remGet(t, pool, ev.ID); r.State != "confirmed" {
		t.Fatalf("rollback after confirm changed the row: %+v", r)
	}
}

// Claim -> rollback -> claim as fast as the machine goes: stamps come from a sequence, so they
// differ even within one microsecond, and the first stamp is dead afterwards.
func TestReminderClaimRollbackClaimMachineSpeed(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	ctx := context.Background()
	ev := remDue(t, pool)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	seen := map[int64]bool{}
	var prev int64
	for i := 0; i < 500; i++ {
		// One pipelined round trip: the steps run back to back on one backend, microseconds apart.
		batch := &pgx.Batch{}
		batch.Queue(`SELECT buzz.rollback_reminder_claim($1, $2, $3)`, ev.ID, int64(ev.CreatedAt), prev)
		batch.Queue(`SELECT buzz.claim_due_reminder($1, $2)`, ev.ID, int64(ev.CreatedAt))
		batch.Queue(`SELECT buzz.rollback_reminder_claim($1, $2, currval('buzz.reminder_stamp_seq'))`, ev.ID, int64(ev.CreatedAt))
		batch.Queue(`SELECT buzz.claim_due_reminder($1, $2)`, ev.ID, int64(ev.CreatedAt))
		br := conn.SendBatch(ctx, batch)
		var first, second *int64
		var ok, prevOK bool
		if err := br.QueryRow().Scan(&prevOK); err != nil {
			t.Fatal(err)
		}
		if err := br.QueryRow().Scan(&first); err != nil {
			t.Fatal(err)
		}
		if err := br.QueryRow().Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if err := br.QueryRow().Scan(&second); err != nil {
			t.Fatal(err)
		}
		br.Close()
		if first == nil || second == nil || !ok {
			t.Fatalf("iteration %d: claim %v, rollback %v, claim %v", i, first, ok, second)
		}
		if *first == *second || seen[*first] || seen[*second] {
			t.Fatalf("iteration %d: stamps not unique: %d, %d", i, *first, *second)
		}
		seen[*first], seen[*second] = true, true
		prev = *second
		if remBoolCall(t, pool, "rollback_reminder_claim", ev, *first) {
			t.Fatalf("iteration %d: rollback with the first (stale) stamp returned true", i)
		}
		if r := remGet(t, pool, ev.ID); r.State != "claimed" || *r.Stamp != *second {
			t.Fatalf("iteration %d: stale rollback changed the row: %+v", i, r)
		}
	}
}

// A stale confirm emits nothing; the current one emits exactly one due message with its stamp.
// Checked on the WAL itself through a test_decoding slot on a database of its own.
func TestReminderStaleConfirmEmitsNothing(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	slot := remNewSlot(t, pool)
	ev := remDue(t, pool)
	s1 := remClaimLease(t, pool, ev, 20*time.Millisecond)
	remWaitLeaseExpired(t, pool, ev.ID)
	s2 := remClaim(t, pool, ev)
	if s1 == nil || s2 == nil {
		t.Fatalf("claims %v %v", s1, s2)
	}
	single := remBoolCall(t, pool, "confirm_reminder_claim", ev, *s1)
	if msgs := slot.dueMessages(t); len(msgs) != 0 {
		t.Fatalf("stale confirm_reminder_claim emitted %d due messages: %v", len(msgs), msgs)
	}
	var ids []string
	if err := pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(x), '{}') FROM buzz.confirm_reminder_claims($1, $2) x`,
		[]string{ev.ID}, []int64{*s1}).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	if msgs := slot.dueMessages(t); len(msgs) != 0 {
		t.Fatalf("stale confirm_reminder_claims emitted %d due messages: %v", len(msgs), msgs)
	}
	if single || len(ids) != 0 {
		t.Fatalf("stale confirms reported success: single %v, batch %v", single, ids)
	}
	if !remBoolCall(t, pool, "confirm_reminder_claim", ev, *s2) {
		t.Fatal("current confirm returned false")
	}
	if remBoolCall(t, pool, "confirm_reminder_claim", ev, *s2) {
		t.Fatal("second confirm with the same stamp returned true")
	}
	msgs := slot.dueMessages(t)
	if len(msgs) != 1 {
		t.Fatalf("%d due messages after one confirm, want 1: %v", len(msgs), msgs)
	}
	m := msgs[0]
	evj, _ := m["ev"].(map[string]any)
	if m["scope"] != "a" || fmt.Sprint(m["stamp"]) != fmt.Sprint(*s2) || evj["id"] != ev.ID || evj["sig"] != ev.Sig ||
		evj["pubkey"] != ev.PubKey || evj["content"] != ev.Content || fmt.Sprint(evj["kind"]) != "30300" {
		t.Fatalf("due message %v does not carry the stored event %s with stamp %d", m, ev.ID, *s2)
	}

	// The batch form with a current stamp emits exactly one signal, carrying the event; again, none.
	ev2 := remDue(t, pool)
	s3 := remClaim(t, pool, ev2)
	if s3 == nil {
		t.Fatal("claim of a second due reminder failed")
	}
	for round, want := range []int{1, 0} {
		if err := pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(x), '{}') FROM buzz.confirm_reminder_claims($1, $2) x`,
			[]string{ev2.ID}, []int64{*s3}).Scan(&ids); err != nil {
			t.Fatal(err)
		}
		if len(ids) != want {
			t.Fatalf("batch confirm round %d confirmed %v, want %d", round, ids, want)
		}
	}
	msgs = slot.dueMessages(t)
	if len(msgs) != 1 {
		t.Fatalf("%d due signals after one batch confirm, want 1: %v", len(msgs), msgs)
	}
	evj, _ = msgs[0]["ev"].(map[string]any)
	if fmt.Sprint(msgs[0]["stamp"]) != fmt.Sprint(*s3) || evj["id"] != ev2.ID || evj["sig"] != ev2.Sig || evj["content"] != ev2.Content {
		t.Fatalf("batch due signal %v does not carry %s with stamp %d", msgs[0], ev2.ID, *s3)
	}
}

// Not due, cancelled, confirmed or expired versions are never claimed.
func TestReminderClaimOnlyWhenDue(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	ctx := context.Background()
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()

	future := remEvent(t, sk, now, "future", remNB(now+3600))
	remMustAccept(t, pool, future)
	if s := remClaim(t, pool, future); s != nil {
		t.Fatal("claimed a reminder before its not_before")
	}

	// Expired: the expiration passed (stored while still valid: expiration > not_before, both
	// in the past relative to the claim) -> never due, and the batch claim cancels it.
	exp := remEvent(t, sk, now-10, "expired", remNB(now-5), []string{"expiration", fmt.Sprint(now - 1)})
	if _, err := pool.Exec(ctx, `INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, expires_at)
		VALUES ($1, $2, 'expired', $3, $4, $5)`, exp.ID, exp.PubKey, int64(exp.CreatedAt), now-5, now-1); err != nil {
		t.Fatal(err)
	}
	if s := remClaim(t, pool, exp); s != nil {
		t.Fatal("claimed an expired reminder")
	}

	old := remEvent(t, sk, now-1, "x", remNB(now-2))
	remMustAccept(t, pool, old)
	newer := remEvent(t, sk, now, "x", remNB(now+3600))
	remMustAccept(t, pool, newer)
	if r := remGet(t, pool, old.ID); r.State != "cancelled" {
		t.Fatalf("older version %+v, want cancelled by the newer one", r)
	}
	if s := remClaim(t, pool, old); s != nil {
		t.Fatal("claimed a cancelled version")
	}
	// Wrong created_at: the (id, created_at) pair names the version.
	due := remDue(t, pool)
	var s *int64
	testenv.MustScan(t, pool.QueryRow(ctx, `SELECT buzz.claim_due_reminder($1, $2)`, due.ID, int64(due.CreatedAt)+1), &s)
	if s != nil {
		t.Fatal("claimed with a wrong created_at")
	}
}

// Which arms wake the schedulers (sql/0004_reminders.up.sql, arm_reminder). Schedulers sleep until the earliest armed reminder,
// so a reminder due after one they already sleep until stays quiet (NOTIFY serialises commits).
// But an earlier reminder that is due now may be mid-claim: the scheduler would ask for its next
// wake-up before the new row commits, and sleep MaxSleep with it due. So an arm stays quiet only
// behind an earlier reminder due more than a second from now. Notifications come in commit order,
// so a marker sent after each step closes the list of what that step sent.
func TestReminderArmWakesSchedulersUnlessOneIsComing(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	listen := testenv.NewSession(t, url, "rem-listen")
	if _, err := listen.Conn.Exec(ctx, `LISTEN buzz_reminders`); err != nil {
		t.Fatal(err)
	}
	marker := 0
	sent := func() []string {
		t.Helper()
		marker++
		m := fmt.Sprintf("marker-%d", marker)
		if _, err := pool.Exec(ctx, `SELECT pg_notify('buzz_reminders', $1)`, m); err != nil {
			t.Fatal(err)
		}
		var got []string
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		for {
			n, err := listen.Conn.WaitForNotification(wctx)
			if err != nil {
				t.Fatalf("waiting for %s: %v (so far %q)", m, err, got)
			}
			if n.Payload == m {
				return got
			}
			got = append(got, n.Payload)
		}
	}
	expect := func(step string, want ...string) {
		t.Helper()
		if got := sent(); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("%s: notified %q, want %q", step, got, want)
		}
	}
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	nb := func(n int64) string { return fmt.Sprint(n) }

	remMustAccept(t, pool, remEvent(t, sk, now, "hour", remNB(now+3600)))
	expect("the first armed reminder", nb(now+3600))
	remMustAccept(t, pool, remEvent(t, sk, now, "two-hours", remNB(now+7200)))
	expect("a reminder due after one the schedulers sleep until")
	remMustAccept(t, pool, remEvent(t, sk, now, "half-hour", remNB(now+1800)))
	expect("a reminder due before every other", nb(now+1800))

	// A due reminder is being claimed (the claim not committed yet) while another one, due now
	// too, is armed: the arm still sees the first one armed, and must not count on it.
	due := remDue(t, pool)
	expect("the due reminder", nb(int64(due.CreatedAt)-2))
	claimer := testenv.NewSession(t, url, "rem-claimer")
	claimer.Begin()
	if remClaim(t, claimer.Tx, due) == nil {
		t.Fatal("the due reminder could not be claimed")
	}
	remMustAccept(t, pool, remEvent(t, sk, now, "now", remNB(now)))
	claimer.Commit()
	expect("a reminder armed while an earlier due one is being claimed", nb(now))
}

// NIP-ER: deleting a reminder cancels it, by id (e tag) or by address (a tag), armed or already
// claimed; a stale claimer can then confirm nothing. Someone else's deletion cancels nothing.
func TestReminderDeletionCancels(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	sk, pk := testenv.NewKey()
	otherSK, _ := testenv.NewKey()
	now := time.Now().Unix()
	deletion := func(sk string, tag nostr.Tag) {
		t.Helper()
		ev := &nostr.Event{Kind: 5, CreatedAt: nostr.Timestamp(now), Tags: nostr.Tags{tag}, Content: fmt.Sprint(remNonce.Add(1))}
		if err := ev.Sign(sk); err != nil {
			t.Fatal(err)
		}
		remMustAccept(t, pool, ev)
	}

	armed := remEvent(t, sk, now-1, "by-id", remNB(now+3600))
	remMustAccept(t, pool, armed)
	deletion(otherSK, nostr.Tag{"e", armed.ID})
	if r := remGet(t, pool, armed.ID); r.State != "armed" {
		t.Fatalf("someone else's deletion: %+v, want armed", r)
	}
	deletion(sk, nostr.Tag{"e", armed.ID})
	if r := remGet(t, pool, armed.ID); r.State != "cancelled" {
		t.Fatalf("deleted by id: %+v, want cancelled", r)
	}

	claimed := remEvent(t, sk, now-1, "by-address", remNB(now-2))
	remMustAccept(t, pool, claimed)
	stamp := remClaim(t, pool, claimed)
	if stamp == nil {
		t.Fatal("a due reminder was not claimed")
	}
	deletion(sk, nostr.Tag{"a", fmt.Sprintf("30300:%s:by-address", pk)})
	if r := remGet(t, pool, claimed.ID); r.State != "cancelled" {
		t.Fatalf("deleted by address while claimed: %+v, want cancelled", r)
	}
	if remBoolCall(t, pool, "confirm_reminder_claim", claimed, *stamp) {
		t.Fatal("the claimer confirmed a deleted reminder")
	}
}

// A newer version stored before not_before re-arms (the old one is cancelled, the new one
// armed); a newer version stored after the due signal was sent cancels nothing already sent.
func TestReminderNewerVersionRearmsOrLeavesSentAlone(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	v1 := remEvent(t, sk, now-3, "addr", remNB(now+3600))
	remMustAccept(t, pool, v1)
	v2 := remEvent(t, sk, now-2, "addr", remNB(now-1))
	remMustAccept(t, pool, v2)
	if r := remGet(t, pool, v1.ID); r.State != "cancelled" {
		t.Fatalf("v1 %+v, want cancelled", r)
	}
	s := remClaim(t, pool, v2)
	if s == nil || !remBoolCall(t, pool, "confirm_reminder_claim", v2, *s) {
		t.Fatal("v2 not claimable/confirmable")
	}
	v3 := remEvent(t, sk, now-1, "addr", remNB(now+3600))
	remMustAccept(t, pool, v3)
	if r := remGet(t, pool, v2.ID); r.State != "confirmed" {
		t.Fatalf("v2 after v3: %+v, want still confirmed", r)
	}
	if r := remGet(t, pool, v3.ID); r.State != "armed" {
		t.Fatalf("v3 %+v, want armed", r)
	}
	// A newer version without not_before cancels the armed one and arms nothing.
	v4 := remEvent(t, sk, now, "addr")
	remMustAccept(t, pool, v4)
	if r := remGet(t, pool, v3.ID); r.State != "cancelled" {
		t.Fatalf("v3 after v4: %+v, want cancelled", r)
	}
}

// The batch claim takes disjoint sets under concurrency, recovers expired leases, and status
// shows what an operator needs.
func TestReminderBatchClaimDisjointAndStatus(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	const n = 600
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	for i := 0; i < n; i++ {
		remMustAccept(t, pool, remEvent(t, sk, now, fmt.Sprint("b", i), remNB(now-1)))
	}
	var st struct{ armed, due, claimed, stuck, confirmed, cancelled, recovered int64 }
	status := func() {
		t.Helper()
		var late *time.Duration
		var next *int64
		if err := pool.QueryRow(ctx, `SELECT armed, due, claimed, stuck, confirmed, cancelled, recovered, oldest_due_lateness, next_not_before FROM buzz.reminder_status()`).
			Scan(&st.armed, &st.due, &st.claimed, &st.stuck, &st.confirmed, &st.cancelled, &st.recovered, &late, &next); err != nil {
			t.Fatal(err)
		}
	}
	status()
	if st.due != n || st.claimed != 0 {
		t.Fatalf("status before claims: %+v", st)
	}
	// Four concurrent batch claimers: every id claimed exactly once, each claim with its own stamp
	// (I5: a stamp names one claim; a stamp shared by two rows, say one drawn once per statement,
	// would let a confirm or rollback with one row's stamp act on the other's claim).
	var mu sync.Mutex
	got := map[string]int{}
	var firstStamps []int64
	var wg sync.WaitGroup
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				rows, err := pool.Query(ctx, `SELECT id, stamp FROM buzz.claim_due_reminders(100, '10 minutes')`)
				if err != nil {
					t.Error(err)
					return
				}
				claims, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
					ID    string
					Stamp int64
				}])
				if err != nil {
					t.Error(err)
					return
				}
				if len(claims) == 0 {
					return
				}
				mu.Lock()
				for _, c := range claims {
					got[c.ID]++
					firstStamps = append(firstStamps, c.Stamp)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(got) != n {
		t.Fatalf("%d distinct ids claimed, want %d", len(got), n)
	}
	for id, c := range got {
		if c != 1 {
			t.Fatalf("%s claimed %d times before any lease expired", id, c)
		}
	}
	remAssertDistinctStamps(t, "first claims", firstStamps)
	// The owners "die": move the leases into the past (as if 10 minutes went by). They show as
	// stuck, and the next batch recovers them with new stamps.
	if _, err := pool.Exec(ctx, `UPDATE buzz.reminders SET lease_until = now() - interval '1 millisecond' WHERE state = 'claimed'`); err != nil {
		t.Fatal(err)
	}
	if stuck := testenv.MustInt(t, pool, `SELECT stuck FROM buzz.reminder_status()`); stuck != n {
		t.Fatalf("stuck %d, want %d", stuck, n)
	}
	rows, err := pool.Query(ctx, `SELECT id, stamp, recovered FROM buzz.claim_due_reminders($1, '1 minute')`, n)
	if err != nil {
		t.Fatalf("recovery batch: %v", err)
	}
	type rc struct {
		ID        string
		Stamp     int64
		Recovered bool
	}
	rec, err := pgx.CollectRows(rows, pgx.RowToStructByPos[rc])
	if err != nil || len(rec) != n {
		t.Fatalf("recovery batch: %d rows, %v", len(rec), err)
	}
	ids := make([]string, 0, n)
	stamps := make([]int64, 0, n)
	for _, r := range rec {
		if !r.Recovered {
			t.Fatalf("%s not flagged recovered", r.ID)
		}
		ids, stamps = append(ids, r.ID), append(stamps, r.Stamp)
	}
	// One statement recovered all n: each recovery has its own stamp, and none is a stamp of the
	// first claims (the stale owners would otherwise still be able to confirm or roll back).
	remAssertDistinctStamps(t, "recovery claims", stamps)
	remAssertDistinctStamps(t, "first and recovery claims", firstStamps, stamps)
	rows, err = pool.Query(ctx, `SELECT buzz.confirm_reminder_claims($1, $2)`, ids, stamps)
	if err != nil {
		t.Fatalf("batch confirm: %v", err)
	}
	confirmed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(confirmed) != n {
		t.Fatalf("batch confirm: %d, %v", len(confirmed), err)
	}
	status()
	if st.confirmed != n || st.recovered != n || st.claimed != 0 || st.due != 0 || st.stuck != 0 {
		t.Fatalf("status after recovery: %+v", st)
	}
}

func remFmt(ps []*int64) string {
	out := ""
	for _, p := range ps {
		if p == nil {
			out += " NULL"
		} else {
			out += fmt.Sprintf(" %d", *p)
		}
	}
	return out
}

// The reminder lookups can use their partial indexes: a predicate that stops matching the
// queries' state filter would turn every arm and every claim into a scan of the whole history.
// enable_seqscan=off asks whether the index is usable at all, independent of table size.
func TestReminderLookupsUsePartialIndexes(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SET enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ sql, index string }{
		{`UPDATE buzz.reminders r SET state = 'cancelled' WHERE r.pubkey = 'a' AND r.d_tag = 'b' AND r.state IN ('armed', 'claimed')`, "reminders_address_idx"},
		{`UPDATE buzz.reminders SET state = 'cancelled' WHERE pubkey = 'a' AND d_tag = 'b' AND created_at <= 5 AND state IN ('armed', 'claimed')`, "reminders_address_idx"},
		{`SELECT id FROM buzz.reminders x WHERE x.state = 'armed' AND x.not_before <= 5 ORDER BY x.not_before LIMIT 10`, "reminders_due_idx"},
		{`SELECT id FROM buzz.reminders x WHERE x.state = 'claimed' AND x.lease_until < now() ORDER BY x.lease_until LIMIT 10`, "reminders_lease_idx"},
	} {
		var plan strings.Builder
		rows, err := conn.Query(ctx, `EXPLAIN `+c.sql)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var line string
			_ = rows.Scan(&line)
			plan.WriteString(line + "\n")
		}
		rows.Close()
		if !strings.Contains(plan.String(), c.index) {
			t.Errorf("%s\ndoes not use %s:\n%s", c.sql, c.index, plan.String())
		}
	}
}

// A version stored again once its successor was deleted by id is the newest version again: a
// version that was cancelled before it was due is armed again; one whose due signal went out
// stays confirmed, so the signal is never sent twice (I6).
func TestReminderVersionStoredAgainAfterItsSuccessorWasDeleted(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	deleteByID := func(ev *nostr.Event) {
		t.Helper()
		del := &nostr.Event{Kind: 5, CreatedAt: nostr.Timestamp(now), Tags: nostr.Tags{{"e", ev.ID}}, Content: fmt.Sprint(remNonce.Add(1))}
		if err := del.Sign(sk); err != nil {
			t.Fatal(err)
		}
		remMustAccept(t, pool, del)
	}

	v1 := remEvent(t, sk, now-3, "cancelled-one", remNB(now+3600))
	remMustAccept(t, pool, v1)
	v2 := remEvent(t, sk, now-2, "cancelled-one", remNB(now+3600))
	remMustAccept(t, pool, v2)
	deleteByID(v2)
	remMustAccept(t, pool, v1) // an error here (23505) would be answered "error:" on every retry
	if r := remGet(t, pool, v1.ID); r.State != "armed" {
		t.Fatalf("v1 stored again: %+v, want armed", r)
	}

	w1 := remEvent(t, sk, now-3, "sent-one", remNB(now-2))
	remMustAccept(t, pool, w1)
	s := remClaim(t, pool, w1)
	if s == nil || !remBoolCall(t, pool, "confirm_reminder_claim", w1, *s) {
		t.Fatal("w1 not claimable/confirmable")
	}
	w2 := remEvent(t, sk, now-2, "sent-one", remNB(now+3600))
	remMustAccept(t, pool, w2)
	deleteByID(w2)
	remMustAccept(t, pool, w1)
	if r := remGet(t, pool, w1.ID); r.State != "confirmed" || r.Claims != 1 {
		t.Fatalf("w1 stored again after its signal went out: %+v, want still confirmed, claimed once", r)
	}
	if again := remClaim(t, pool, w1); again != nil {
		t.Fatalf("w1 claimed a second time (stamp %d): its due signal would go out twice", *again)
	}
}
