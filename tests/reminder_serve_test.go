package tests

// NIP-ER across real `buzzpg serve` processes (built with -tags testhooks by testenv).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// remStoreMany stores events through accept_event, 250 per transaction (test setup: the relay's
// EVENT path is covered elsewhere; here the point is many reminders due in one second).
func remStoreMany(t testing.TB, pool *pgxpool.Pool, evs []*nostr.Event) {
	t.Helper()
	ctx := context.Background()
	for i := 0; i < len(evs); i += 250 {
		batch := &pgx.Batch{}
		for _, ev := range evs[i:min(i+250, len(evs))] {
			raw, _ := json.Marshal(ev)
			batch.Queue(`SELECT buzz.accept_event($1::jsonb)`, string(raw))
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return tx.SendBatch(ctx, batch).Close() }); err != nil {
			t.Fatal(err)
		}
	}
}

// remStoreRolledBack stores events through accept_event in one transaction and rolls it back
// (measuring what storing costs without keeping anything).
func remStoreRolledBack(t testing.TB, pool *pgxpool.Pool, evs []*nostr.Event) {
	t.Helper()
	ctx := context.Background()
	batch := &pgx.Batch{}
	for _, ev := range evs {
		raw, _ := json.Marshal(ev)
		batch.Queue(`SELECT buzz.accept_event($1::jsonb)`, string(raw))
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		t.Fatal(err)
	}
}

// remBulkStore inserts signed 30300 versions (distinct d tags, all with not_before nb) the way
// accept_event stores them, in one statement, and wakes the schedulers.
func remBulkStore(t testing.TB, pool *pgxpool.Pool, evs []*nostr.Event, nb int64) {
	t.Helper()
	raw := make([]string, len(evs))
	for i, ev := range evs {
		b, _ := json.Marshal(ev)
		raw[i] = string(b)
	}
	_, err := pool.Exec(context.Background(), `
		WITH ins AS (
		  INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals, scope)
		  SELECT e->>'id', e->>'pubkey', (e->>'created_at')::bigint, 30300, e->'tags', e->>'content', e->>'sig',
		         (buzz.tag_values(e->'tags', 'd'))[1], buzz.event_tagvals(e->'tags'), 'a'
		    FROM unnest($1::jsonb[]) AS u(e)
		  RETURNING id, pubkey, d_tag, created_at)
		INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before)
		SELECT id, pubkey, d_tag, created_at, $2 FROM ins`, raw, nb)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(context.Background(), `SELECT pg_notify('buzz_reminders', $1)`, fmt.Sprint(nb)); err != nil {
		t.Fatal(err)
	}
}

func remHookReached(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "reminder.after_claim.reached"))
	return err == nil
}

// Crash after claim, before publish: the process holding the claim is killed with SIGKILL at
// the reminder.after_claim hook; the other process recovers the claim after its lease and the
// author's live subscription on it receives the due signal exactly once.
func TestReminderCrashAfterClaimRecoveredOnce(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	relayKey, _ := testenv.NewKey()
	sk, pk := testenv.NewKey()
	env := map[string]string{"BUZZ_REMINDER_LEASE": "2s"}
	dirs := [2]string{t.TempDir(), t.TempDir()}
	var relays [2]*testenv.Relay
	var subs [2]*testenv.Sub
	for i := range relays {
		relays[i] = testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, RelayKey: relayKey, Env: env,
			HookDir: dirs[i], Hooks: []string{"reminder.after_claim"}})
		subs[i] = remDueSub(t, relays[i].URL, sk, pk)
	}

	now := time.Now().Unix()
	ev := remEvent(t, sk, now, "crash", remNB(now-1))
	remMustAccept(t, pool, ev)

	// Whichever process claimed it stops at the hook: that one dies.
	deadline := time.Now().Add(30 * time.Second)
	x := -1
	for x < 0 && time.Now().Before(deadline) {
		for i, d := range dirs {
			if remHookReached(d) {
				x = i
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	if x < 0 {
		t.Fatal("no process reached reminder.after_claim")
	}
	y := 1 - x
	hooks.Release(t, dirs[y], "reminder.after_claim") // the survivor may pass its hook
	if r := remGet(t, pool, ev.ID); r.State != "claimed" {
		t.Fatalf("at the hook the reminder is %s, want claimed", r.State)
	}
	relays[x].Kill()

	// The due signal reaches the author on the survivor. Barrier: a second reminder due now, whose
	// due signal is emitted after the first was delivered; once it is in, a duplicate of the first
	// emitted or resent before it would have arrived too.
	subs[y].WaitEvents(30*time.Second, ev.ID)
	remDueBarrier(t, pool, sk, subs[y])
	if n := subs[y].Counts()[ev.ID]; n != 1 {
		t.Fatalf("the author's subscription on the survivor received the due signal %d times, want 1", n)
	}
	r := remGet(t, pool, ev.ID)
	if r.State != "confirmed" || r.Claims != 2 || r.Recoveries != 1 {
		t.Fatalf("reminder after recovery: %+v, want confirmed after 2 claims, 1 recovery", r)
	}
}

// Two processes, 1,000 reminders due in the same second, the author connected to one of them:
// each due signal arrives exactly once, whichever process claimed it.
func TestReminderBurstTwoProcesses(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	relayKey, _ := testenv.NewKey()
	sk, pk := testenv.NewKey()
	a := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, RelayKey: relayKey})
	b := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, RelayKey: relayKey})
	// Not Strict: verifying 10,000 signatures inside the client's reader would delay the receive
	// times being measured; they are verified after collection instead.
	due := remDueSubWith(t, a.URL, sk, pk)
	if os.Getenv("BUZZ_REMINDER_BURST_LOG") != "" {
		defer func() {
			for _, r := range []*testenv.Relay{a, b} {
				for _, line := range strings.Split(r.Log(), "\n") {
					if strings.Contains(line, `"reminder batch"`) || strings.Contains(line, "reminder scheduler sleeping") {
						t.Log(r.InstanceID, line)
					}
				}
			}
		}()
	}

	// BUZZ_REMINDER_BURST=10000 turns this into the multi-process burst benchmark.
	n := testenv.EnvInt("BUZZ_REMINDER_BURST", 1000)
	t0 := time.Now()
	evs := make([]*nostr.Event, n)
	var nb int64
	if n <= 1000 {
		// All must be stored before they are due, and the test then idles until not_before: the
		// lead time comes from the measured cost of signing and storing a sample (in a
		// transaction rolled back, so nothing of it stays), three times over plus 5 s for load.
		cal := time.Now()
		sample := make([]*nostr.Event, 100)
		for i := range sample {
			sample[i] = remEvent(t, sk, t0.Unix(), fmt.Sprint("calibration", i), remNB(t0.Unix()+3600))
		}
		remStoreRolledBack(t, pool, sample)
		perEvent := time.Since(cal) / time.Duration(len(sample))
		nb = time.Now().Add(5*time.Second+3*time.Duration(n)*perEvent).Unix() + 1
		for i := range evs {
			evs[i] = remEvent(t, sk, t0.Unix(), fmt.Sprint("burst", i), remNB(nb))
		}
		remStoreMany(t, pool, evs)
	} else {
		// Large bursts: accept_event for each would take longer than any sane lead time on a
		// loaded machine, so the signed events are bulk-inserted as accept_event stores them
		// (event row with its read scope and tag index, armed reminder row). The lead time comes
		// from the measured signing rate.
		cal := time.Now()
		for i := 0; i < 200; i++ {
			remEvent(t, sk, t0.Unix(), "calibration", remNB(t0.Unix()))
		}
		perEvent := time.Since(cal) / 200
		nb = time.Now().Add(5*time.Second + 3*time.Duration(n)*perEvent/2 + time.Duration(n)*time.Millisecond/2).Unix()
		for i := range evs {
			evs[i] = remEvent(t, sk, t0.Unix(), fmt.Sprint("burst", i), remNB(nb))
		}
		remBulkStore(t, pool, evs, nb)
	}
	var armed int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.reminders WHERE state = 'armed'`).Scan(&armed)
	if armed != n {
		t.Fatalf("%d of %d armed after storing (took %s); due too early, raise the lead time", armed, n, time.Since(t0))
	}
	t.Logf("stored %d in %s, due %s later", n, time.Since(t0).Round(time.Millisecond), time.Until(time.Unix(nb, 0)).Round(time.Millisecond))
	ids := make([]string, n)
	for i, ev := range evs {
		ids[i] = ev.ID
	}
	due.WaitEvents(time.Duration(60+n/100)*time.Second, ids...)
	// Barrier instead of a grace period: a duplicate of any burst signal emitted (or resent by the
	// stream) before the barrier's signal arrives before it on this subscription.
	barrier := remDueBarrier(t, pool, sk, due)
	counts := due.Counts()
	delete(counts, barrier)
	late := make([]time.Duration, 0, n)
	for _, ev := range evs {
		if counts[ev.ID] != 1 {
			t.Errorf("%s delivered %d times, want 1", ev.ID, counts[ev.ID])
		}
		late = append(late, due.FirstAt(ev.ID).Sub(time.Unix(nb, 0)))
	}
	if len(counts) != n {
		t.Errorf("%d distinct events delivered, want %d", len(counts), n)
	}
	for _, ev := range due.Events() {
		if ok, _ := ev.CheckSignature(); !ok || !ev.CheckID() {
			t.Fatalf("due signal %s has a bad id or signature", ev.ID)
		}
	}
	p := remPercentilesT(late)
	t.Logf("%d due in one second, 2 processes, author on one: delivery - not_before p50 %s p99 %s max %s", n, p[0], p[1], p[2])
	var e50, e99, emax float64
	_ = pool.QueryRow(context.Background(), `SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY x), percentile_cont(0.99) WITHIN GROUP (ORDER BY x), max(x)
		FROM (SELECT extract(epoch FROM confirmed_at - to_timestamp(not_before)) AS x FROM buzz.reminders WHERE state = 'confirmed' AND id <> $1) s`, barrier).Scan(&e50, &e99, &emax)
	t.Logf("emitted (confirmed_at) - not_before: p50 %.3fs p99 %.3fs max %.3fs", e50, e99, emax)
	var byProc int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.reminders WHERE state = 'confirmed' AND claims = 1 AND id <> $1`, barrier).Scan(&byProc)
	if byProc != n {
		t.Errorf("%d of %d confirmed on the first claim", byProc, n)
	}
}

// A newer version stored before not_before re-arms (only the newer one is delivered); one stored
// after the due signal was sent cancels nothing already sent and sends nothing itself.
func TestReminderNewerVersionAcrossProcesses(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	relayKey, _ := testenv.NewKey()
	sk, pk := testenv.NewKey()
	a := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, RelayKey: relayKey})
	testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, RelayKey: relayKey})
	due := remDueSub(t, a.URL, sk, pk)

	now := time.Now().Unix()
	// v1 is due 10 s out: v2 must be stored before then, even on a loaded machine.
	v1 := remEvent(t, sk, now-2, "addr", remNB(now+10))
	remMustAccept(t, pool, v1)
	v2 := remEvent(t, sk, now-1, "addr", remNB(now+11)) // re-arms before v1 was due
	remMustAccept(t, pool, v2)
	due.WaitEvents(30*time.Second, v2.ID)
	v3 := remEvent(t, sk, now, "addr", remNB(now+3600)) // after the due signal was sent
	remMustAccept(t, pool, v3)
	// Barrier: a reminder due now, stored after v3; a due signal of v1 or v3 (or a second one of v2)
	// emitted before the barrier's arrives before it.
	remDueBarrier(t, pool, sk, due)
	got := due.Counts()
	if got[v1.ID] != 0 || got[v2.ID] != 1 || got[v3.ID] != 0 {
		t.Fatalf("due deliveries v1=%d v2=%d v3=%d, want 0, 1, 0", got[v1.ID], got[v2.ID], got[v3.ID])
	}
	for _, w := range []struct {
		ev    *nostr.Event
		state string
	}{{v1, "cancelled"}, {v2, "confirmed"}, {v3, "armed"}} {
		if r := remGet(t, pool, w.ev.ID); r.State != w.state {
			t.Errorf("%s is %s, want %s", w.ev.ID, r.State, w.state)
		}
	}
}

// remDueSub connects to url as sk and subscribes to pk's reminders with since far in the future:
// stored events never match it, but due signals do (they match ignoring since/until), so every
// EVENT counted on it is a due delivery. Strict: each one's signature is checked, and the relay
// must not close the subscription.
func remDueSub(t testing.TB, url, sk, pk string) *testenv.Sub {
	t.Helper()
	return remDueSubWith(t, url, sk, pk, testenv.Strict())
}

func remDueSubWith(t testing.TB, url, sk, pk string, opts ...testenv.ClientOption) *testenv.Sub {
	t.Helper()
	c := testenv.Dial(t, url, opts...)
	c.Auth(sk)
	since := nostr.Timestamp(time.Now().Unix() + 10*365*24*3600)
	return c.Subscribe(nostr.Filter{Kinds: []int{30300}, Authors: []string{pk}, Since: &since})
}

// remDueBarrier stores a reminder by sk that is already due (its own d tag, so it re-arms
// nothing) and waits until its due signal arrived on due: the processes emit due signals in the
// order they confirm them and each process hands one subscription its events in commit order, so
// once the barrier's signal is in, every signal emitted or resent before it has arrived as well
// (the fan-out tests' barrier event, for a subscription that only sees due signals). The barrier
// is excluded from the callers' counts by id.
func remDueBarrier(t testing.TB, pool *pgxpool.Pool, sk string, due *testenv.Sub) (id string) {
	t.Helper()
	now := time.Now().Unix()
	b := remEvent(t, sk, now, fmt.Sprint("barrier", remNonce.Add(1)), remNB(now-1))
	remMustAccept(t, pool, b)
	due.WaitEvents(60*time.Second, b.ID)
	if n := due.Counts()[b.ID]; n != 1 {
		t.Fatalf("barrier due signal arrived %d times, want 1", n)
	}
	return b.ID
}

func remPercentilesT(ds []time.Duration) [3]time.Duration {
	s := append([]time.Duration(nil), ds...)
	slices.Sort(s)
	if len(s) == 0 {
		return [3]time.Duration{}
	}
	return [3]time.Duration{s[len(s)/2], s[int(0.99*float64(len(s)-1))], s[len(s)-1]}
}
