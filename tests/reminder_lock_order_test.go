package tests

// The row-lock order of sql/0004_reminders.up.sql: buzz.events rows, then buzz.reminders rows, each by id, taken
// by every writer of several rows before it writes. Each test pauses one transaction while it
// holds some of its rows (a trigger that waits on an advisory lock a holder session keeps), runs
// the other until it waits, releases the first, and checks that no deadlock (40P01) broke the two
// apart and that the outcome is the one of the order they committed in. No sleeps: every step
// waits for database state (testenv.WaitBlockedOrDone).
//
// Without 0023 each test deadlocks: PostgreSQL breaks the cycle after deadlock_timeout with 40P01
// on one side. (The reversed variant of TestReminderBatchBesideADeletionOfItsRows does only once
// apply_deletion follows the order and the batch does not: it guards the batch's own ordering.)

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// lockStep is one side of an interleaving: a session and what it runs there.
type lockStep struct {
	name string
	pid  uint32
	run  func() error
}

// lockAcceptStep accepts ev in a transaction of its own session and commits it.
func lockAcceptStep(t *testing.T, url, name string, ev *nostr.Event) lockStep {
	t.Helper()
	s := testenv.NewSession(t, url, name)
	return lockStep{name, s.PID, func() error {
		ctx := context.Background()
		tx, err := s.Conn.Begin(ctx)
		if err != nil {
			return err
		}
		ok, msg, err := remAccept(ctx, tx, ev)
		if err == nil && !ok {
			err = fmt.Errorf("rejected: %s", msg)
		}
		if err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		return tx.Commit(ctx)
	}}
}

// lockBatchStep calls buzz.<fn>(ids, stamps) (the scheduler's batch confirm or rollback) in
// autocommit, as listener/reminder.go does, and stores the ids it returns, sorted, in out.
func lockBatchStep(t *testing.T, url, name, fn string, ids []string, stamps []int64, out *[]string) lockStep {
	t.Helper()
	s := testenv.NewSession(t, url, name)
	return lockStep{name, s.PID, func() error {
		return s.Conn.QueryRow(context.Background(),
			`SELECT coalesce(array_agg(x ORDER BY x), '{}') FROM buzz.`+fn+`($1, $2) x`, ids, stamps).Scan(out)
	}}
}

// lockInterleave runs first until it waits (paused by a trigger), then second until it waits,
// releases the pause, and returns both outcomes.
func lockInterleave(t *testing.T, pool *pgxpool.Pool, first, second lockStep, release func()) (err1, err2 error) {
	t.Helper()
	done1 := testenv.Async(func() { err1 = first.run() })
	if !testenv.WaitBlockedOrDone(t, pool, first.pid, done1) {
		t.Fatalf("%s did not pause: %v", first.name, err1)
	}
	done2 := testenv.Async(func() { err2 = second.run() })
	if !testenv.WaitBlockedOrDone(t, pool, second.pid, done2) {
		release()
		<-done1
		t.Fatalf("%s did not wait for %s's rows: %v", second.name, first.name, err2)
	}
	release()
	<-done1
	<-done2
	return err1, err2
}

// pauseReminderUpdatesBy makes every row UPDATE of buzz.reminders run by the session named
// session wait (in a BEFORE trigger, so holding that row's lock) until release is called.
func pauseReminderUpdatesBy(t *testing.T, url, session string) (release func()) {
	t.Helper()
	return pauseRows(t, url, "pause_reminder_update", "BEFORE UPDATE", "buzz.reminders", "true", session)
}

// lockPair is two due reminders of one author, claimed: lo has the lower id. A deletion names hi
// by address and lo by id, so apply_deletion before 0023 cancelled hi first.
type lockPair struct {
	sk, pk string
	lo, hi *nostr.Event
	ids    []string // lo, hi
	stamps []int64  // their stamps
}

// newLockPair stores and claims lo then hi, or hi then lo when hiFirst: the heap then holds the
// claimed rows in that order, so a plan following the heap visits them in that order too.
func newLockPair(t *testing.T, pool *pgxpool.Pool, hiFirst bool) lockPair {
	t.Helper()
	sk, pk := testenv.NewKey()
	now := time.Now().Unix()
	lo, hi := remEvent(t, sk, now-5, "first", remNB(now-2)), remEvent(t, sk, now-5, "second", remNB(now-2))
	if lo.ID > hi.ID {
		lo, hi = hi, lo
	}
	order := []*nostr.Event{lo, hi}
	if hiFirst {
		order = []*nostr.Event{hi, lo}
	}
	for _, ev := range order {
		remMustAccept(t, pool, ev)
	}
	stamp := map[string]int64{}
	for _, ev := range order {
		s := remClaimLease(t, pool, ev, 10*time.Minute)
		if s == nil {
			t.Fatalf("setup: %.8s not claimed", ev.ID)
		}
		stamp[ev.ID] = *s
	}
	var heap []string
	if err := pool.QueryRow(context.Background(), `SELECT array_agg(id ORDER BY ctid) FROM buzz.reminders WHERE state = 'claimed'`).Scan(&heap); err != nil ||
		!slices.Equal(heap, []string{order[0].ID, order[1].ID}) {
		t.Fatalf("setup: claimed rows in heap order %.8v (%v), want %.8s first", heap, err, order[0].ID)
	}
	return lockPair{sk, pk, lo, hi, []string{lo.ID, hi.ID}, []int64{stamp[lo.ID], stamp[hi.ID]}}
}

// deletion signs the NIP-09 request naming hi by its address and lo by its id.
func (p lockPair) deletion(t *testing.T) *nostr.Event {
	t.Helper()
	ev := &nostr.Event{Kind: 5, CreatedAt: nostr.Now(), Content: "", Tags: nostr.Tags{
		{"a", "30300:" + p.pk + ":" + p.hi.Tags.GetD()}, {"e", p.lo.ID}}}
	if err := ev.Sign(p.sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// states returns the rows' states, lo then hi.
func (p lockPair) states(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	return []string{remGet(t, pool, p.lo.ID).State, remGet(t, pool, p.hi.ID).State}
}

var lockBatches = []string{"confirm_reminder_claims", "rollback_reminder_claims"}

// A deletion cancelling both reminders of a batch, beside the scheduler's batch confirm or
// rollback of them; the deletion goes first. It pauses just before deleting lo's event, by then
// holding its row locks; the batch runs until it waits. Before 0023 the deletion held only hi's
// reminder row (cancelled by address), the batch locked lo and waited for hi, and the deletion,
// released, waited for lo: 40P01. Now the deletion holds both rows, taken by id, and the batch
// waits holding none. The deletion commits first, so both rows are cancelled and the batch,
// its stamps fenced out, changes nothing and emits no due signal.
func TestReminderDeletionBesideABatchOfItsRows(t *testing.T) {
	for _, fn := range lockBatches {
		t.Run(fn, func(t *testing.T) {
			url := testenv.FreshDB(t)
			pool := testenv.Pool(t, url)
			slot := remNewSlot(t, pool)
			p := newLockPair(t, pool, false)

			release := pauseDeleteOf(t, url, p.lo.ID, "BEFORE", "deletion")
			var got []string
			errDel, errBatch := lockInterleave(t, pool,
				lockAcceptStep(t, url, "deletion", p.deletion(t)),
				lockBatchStep(t, url, "scheduler", fn, p.ids, p.stamps, &got), release)
			if errDel != nil || errBatch != nil {
				t.Fatalf("deletion: %v; %s: %v (want both through, no deadlock)", errDel, fn, errBatch)
			}
			if len(got) != 0 {
				t.Errorf("%s after the deletion committed returned %.8v, want nothing (both rows cancelled)", fn, got)
			}
			if s := p.states(t, pool); !slices.Equal(s, []string{"cancelled", "cancelled"}) {
				t.Errorf("states after the deletion and the %s: %v, want both cancelled", fn, s)
			}
			for _, id := range p.ids {
				if r := remGet(t, pool, id); r.Rolls != 0 {
					t.Errorf("row %.8s rolled back %d times by a batch fenced out by the deletion", id, r.Rolls)
				}
			}
			if msgs := slot.dueMessages(t); len(msgs) != 0 {
				t.Errorf("due signals for deleted reminders: %v", msgs)
			}
		})
	}
}

// The same two transactions, the batch first: it pauses inside its UPDATE holding its row locks
// and the deletion runs until it waits. Before 0023 the batch held only lo (the first row its
// plan visited), the deletion cancelled hi by address and waited for lo, and the batch, released,
// waited for hi: 40P01. Now the batch holds both rows, taken by id, and the deletion waits for lo
// before it cancels anything. The batch commits first: a confirm's due signals go out once each,
// under their stamps, and the deletion leaves the confirmed rows alone; rolled-back rows are
// armed again and the deletion then cancels them.
//
// "reversed": the pairs come in descending id order (the listener sorts them, an operator in
// psql need not), so a batch following the array or the heap took hi first: against a deletion
// that locks by id, it held hi and waited for lo while the deletion held lo and waited for hi.
// The batch's own locking subquery is what keeps this one apart.
func TestReminderBatchBesideADeletionOfItsRows(t *testing.T) {
	for _, fn := range lockBatches {
		for _, reversed := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/reversed=%v", fn, reversed), func(t *testing.T) {
				url := testenv.FreshDB(t)
				pool := testenv.Pool(t, url)
				slot := remNewSlot(t, pool)
				p := newLockPair(t, pool, reversed)
				ids, stamps := p.ids, p.stamps
				if reversed {
					ids, stamps = []string{p.ids[1], p.ids[0]}, []int64{p.stamps[1], p.stamps[0]}
				}

				release := pauseReminderUpdatesBy(t, url, "scheduler")
				var got []string
				errBatch, errDel := lockInterleave(t, pool,
					lockBatchStep(t, url, "scheduler", fn, ids, stamps, &got),
					lockAcceptStep(t, url, "deletion", p.deletion(t)), release)
				if errDel != nil || errBatch != nil {
					t.Fatalf("%s: %v; deletion: %v (want both through, no deadlock)", fn, errBatch, errDel)
				}
				if !slices.Equal(got, p.ids) {
					t.Errorf("%s returned %.8v, want both rows %.8v (it committed before the deletion)", fn, got, p.ids)
				}
				var stored int
				if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE id = ANY($1)`, p.ids).Scan(&stored); err != nil || stored != 0 {
					t.Errorf("%d of the deleted reminders' events still stored (%v)", stored, err)
				}
				msgs := slot.dueMessages(t)
				switch fn {
				case "confirm_reminder_claims":
					if s := p.states(t, pool); !slices.Equal(s, []string{"confirmed", "confirmed"}) {
						t.Errorf("states: %v, want both confirmed (the deletion came after their due signals)", s)
					}
					sent := map[string]string{}
					for _, m := range msgs {
						ev, _ := m["ev"].(map[string]any)
						id, _ := ev["id"].(string)
						sent[id] += fmt.Sprint(m["stamp"]) + " "
					}
					want := map[string]string{p.lo.ID: fmt.Sprint(p.stamps[0]) + " ", p.hi.ID: fmt.Sprint(p.stamps[1]) + " "}
					if len(sent) != 2 || sent[p.lo.ID] != want[p.lo.ID] || sent[p.hi.ID] != want[p.hi.ID] {
						t.Errorf("due signals (id -> stamps) %v, want one each under the claims' stamps %v", sent, want)
					}
				default:
					if s := p.states(t, pool); !slices.Equal(s, []string{"cancelled", "cancelled"}) {
						t.Errorf("states: %v, want both cancelled (rolled back to armed, then deleted)", s)
					}
					for _, id := range p.ids {
						if r := remGet(t, pool, id); r.Rolls != 1 {
							t.Errorf("row %.8s: %d rollbacks, want 1", id, r.Rolls)
						}
					}
					if len(msgs) != 0 {
						t.Errorf("due signals after a rollback and a deletion: %v", msgs)
					}
				}
			})
		}
	}
}

// arm_reminder cancels every unconfirmed version of its address. There is one unless rows were
// changed by hand; here two claimed rows of one address were written from psql, hi first (so the
// heap and the address index list hi first). A newer version's acceptance pauses inside the
// cancel; a batch confirm of the two runs until it waits. Before 0023 the cancel held hi (the
// first row its plan visited), the confirm locked lo and waited for hi, and the cancel, released,
// waited for lo: 40P01. Now the acceptance holds both rows, taken by id, and the confirm waits
// holding none; it then finds both cancelled and confirms nothing.
func TestReminderArmCancelsVersionsInIDOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	sk, pk := testenv.NewKey()
	_, lo := testenv.NewKey()
	_, hi := testenv.NewKey()
	if lo > hi {
		lo, hi = hi, lo
	}
	now := time.Now().Unix()
	stamps := map[string]int64{}
	for _, id := range []string{hi, lo} {
		var s int64
		if err := pool.QueryRow(ctx, `
			INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, state, stamp, claimed_at, lease_until, claims)
			VALUES ($1, $2, 'x', $3, $3, 'claimed', nextval('buzz.reminder_stamp_seq'), now(), now() + interval '10 minutes', 1)
			RETURNING stamp`, id, pk, now-10).Scan(&s); err != nil {
			t.Fatal(err)
		}
		stamps[id] = s
	}
	var heap []string
	if err := pool.QueryRow(ctx, `SELECT array_agg(id ORDER BY ctid) FROM buzz.reminders`).Scan(&heap); err != nil || !slices.Equal(heap, []string{hi, lo}) {
		t.Fatalf("setup: heap order %.8v (%v), want hi %.8s first", heap, err, hi)
	}
	newer := remEvent(t, sk, now, "x", remNB(now+3600))

	release := pauseReminderUpdatesBy(t, url, "acceptance")
	var got []string
	errAcc, errConfirm := lockInterleave(t, pool,
		lockAcceptStep(t, url, "acceptance", newer),
		lockBatchStep(t, url, "scheduler", "confirm_reminder_claims", []string{lo, hi}, []int64{stamps[lo], stamps[hi]}, &got),
		release)
	if errAcc != nil || errConfirm != nil {
		t.Fatalf("acceptance of the newer version: %v; confirm: %v (want both through, no deadlock)", errAcc, errConfirm)
	}
	if len(got) != 0 {
		t.Errorf("confirm after the newer version committed returned %.8v, want nothing", got)
	}
	for id, want := range map[string]string{lo: "cancelled", hi: "cancelled", newer.ID: "armed"} {
		if r := remGet(t, pool, id); r.State != want {
			t.Errorf("row %.8s: %s, want %s", id, remShow(r), want)
		}
	}
}

// apply_deletion's DELETEs of buzz.events rows follow the order too. Deletion 1 names two
// addresses X < Y (lock-key order), deletion 2 names their versions x and y by id, with y < x:
// they share no advisory lock. Deletion 1 pauses just after deleting x (holding its row); deletion
// 2 runs until it waits. Before 0023 deletion 1 went X then Y and deletion 2 went y then x: it
// held y while it waited for x, and deletion 1, released, waited for y: 40P01. Now each locks
// y, then x, before it deletes anything.
func TestDeletionsLockEventRowsInIDOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	author := newFanUser()
	now := nostr.Now()
	x := author.eventAt(t, 30023, now-30, nostr.Tag{"d", "a"})
	y := author.eventAt(t, 30023, now-30, nostr.Tag{"d", "b"})
	for i := 1; y.ID > x.ID; i++ {
		y = author.eventAt(t, 30023, now-30-nostr.Timestamp(i), nostr.Tag{"d", "b"})
	}
	fanPsqlAccept(t, url, x)
	fanPsqlAccept(t, url, y)
	byAddress := author.eventAt(t, 5, now, nostr.Tag{"a", "30023:" + author.pk + ":a"}, nostr.Tag{"a", "30023:" + author.pk + ":b"})
	byID := author.eventAt(t, 5, now, nostr.Tag{"e", x.ID}, nostr.Tag{"e", y.ID})

	release := pauseDeleteOf(t, url, x.ID, "AFTER", "deletion-1")
	err1, err2 := pausedThenWaiting(t, url, "deletion-1", byAddress, "deletion-2", byID, release)
	if err1 != nil || err2 != nil {
		t.Fatalf("deletion by address: %v; deletion by id: %v (want both through, no deadlock)", err1, err2)
	}
	pool := testenv.Pool(t, url)
	var left, tombstones int
	if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM buzz.events WHERE id = ANY($1)),
		(SELECT count(*) FROM buzz.deleted_ids WHERE id = ANY($1) AND pubkey = $2)`, []string{x.ID, y.ID}, author.pk).Scan(&left, &tombstones); err != nil {
		t.Fatal(err)
	}
	if left != 0 || tombstones != 2 {
		t.Fatalf("%d of the two events left and %d tombstones, want none left and 2 tombstones", left, tombstones)
	}
	raw, _ := json.Marshal(x)
	var ok bool
	var msg string
	if err := pool.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg); err != nil || ok || msg != "blocked: deleted" {
		t.Fatalf("x published again: ok=%v %q %v, want blocked: deleted", ok, msg, err)
	}
}
