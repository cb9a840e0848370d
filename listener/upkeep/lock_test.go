package upkeep_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/upkeep"
)

// One purger at a time: while another session holds the upkeep lock a pass purges nothing, the
// purge refuses a session without the lock, and of two runners the one paused inside its pass
// (at the leader hook) keeps the other out until it lets go.
func TestUpkeepOneProcessAtATime(t *testing.T) {
	url, pool, a := setup(t)
	ctx := context.Background()
	now := time.Now().Unix()
	expired := func() string { return insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 1000)}) }

	holder := testenv.NewSession(t, url, "upkeep-holder")
	var held bool
	testenv.MustScan(t, holder.Conn.QueryRow(ctx, `SELECT buzz.upkeep_try_lock()`), &held)
	if !held {
		t.Fatal("the holder session could not take the upkeep lock")
	}
	id := expired()
	if leader, err := a.RunOnce(ctx); leader || err != nil {
		t.Fatalf("pass while another session holds the lock: leader=%v err=%v, want false, nil", leader, err)
	}
	if !stored(t, pool, id) {
		t.Fatal("a pass purged while another session held the upkeep lock")
	}
	if _, err := pool.Exec(ctx, `SELECT buzz.upkeep_purge('expired', 10)`); err == nil || !strings.Contains(err.Error(), "restricted") {
		t.Fatalf("upkeep_purge without the lock: err=%v, want restricted", err)
	}
	if !stored(t, pool, id) {
		t.Fatal("upkeep_purge without the lock removed a row")
	}
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_unlock(buzz.upkeep_lock_key())`); err != nil {
		t.Fatal(err)
	}
	mustLead(t, a)
	if stored(t, pool, id) {
		t.Fatal("the pass that took the lock did not purge")
	}

	// Runner a is the leader (its connection keeps the lock). Pause it inside a pass; runner b
	// must not lead meanwhile, nor after, until a's connection ends.
	b := runner(t, url, "b")
	reached, release := make(chan struct{}), make(chan struct{})
	defer hooks.Set(upkeep.HookLeader, func(context.Context) { close(reached); <-release })()
	var aErr error
	done := testenv.Async(func() { _, aErr = a.RunOnce(ctx) })
	<-reached
	hooks.Set(upkeep.HookLeader, nil)
	id = expired()
	if leader, err := b.RunOnce(ctx); leader || err != nil {
		t.Fatalf("second runner during the first's pass: leader=%v err=%v, want false, nil", leader, err)
	}
	if !stored(t, pool, id) {
		t.Fatal("the second runner purged during the first's pass")
	}
	close(release)
	<-done
	if aErr != nil {
		t.Fatal(aErr)
	}
	if leader, _ := b.RunOnce(ctx); leader {
		t.Fatal("the second runner led while the first still holds its connection")
	}
	a.Close() // the lock dies with the connection, once its backend has exited
	testenv.WaitUntil(t, 10*time.Second, "the closed connection's backend to release the upkeep lock", func() bool {
		return testenv.MustInt(t, pool, `SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND ((classid::bigint << 32) | objid::bigint) = buzz.upkeep_lock_key()`) == 0
	})
	mustLead(t, b)
}

// A purge never waits for the hot path: an event whose event:<id> advisory lock (as accept_event
// and apply_deletion take it) or whose row lock is held elsewhere is skipped, not waited for, and
// the next pass removes it. The deadline only turns a wait into a failure.
func TestUpkeepSkipsBusyEvents(t *testing.T) {
	url, pool, u := setup(t)
	now := time.Now().Unix()
	for _, how := range []string{
		`SELECT pg_advisory_xact_lock(hashtextextended('event:' || $1, 0))`,
		`SELECT 1 FROM buzz.events WHERE id = $1 FOR UPDATE`,
	} {
		id := insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 1000)})
		free := insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 1000)})
		holder := testenv.NewSession(t, url, "upkeep-busy")
		holder.Begin()
		if _, err := holder.Tx.Exec(context.Background(), how, id); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		leader, err := u.RunOnce(ctx)
		cancel()
		if err != nil || !leader {
			t.Fatalf("%s: pass with a busy event: leader=%v err=%v, want a pass that skips it", how, leader, err)
		}
		if !stored(t, pool, id) || stored(t, pool, free) {
			t.Fatalf("%s: busy event stored=%v, free event stored=%v; want true, false", how, stored(t, pool, id), stored(t, pool, free))
		}
		if w := testenv.MustInt(t, pool, `SELECT waiting::int FROM buzz.upkeep_status() WHERE rule = 'expired'`); w != 1 {
			t.Errorf("%s: upkeep_status waiting %d, want 1 (the busy event)", how, w)
		}
		holder.Rollback()
		mustLead(t, u)
		if stored(t, pool, id) {
			t.Fatalf("%s: the event was not purged once free", how)
		}
	}
}
