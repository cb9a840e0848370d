package tests

import (
	"context"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/fanout"
)

// startFanoutRelays starts n `buzzpg serve` processes on one database with one relay key.
func startFanoutRelays(t *testing.T, dbURL string, n int, env map[string]string) []*testenv.Relay {
	t.Helper()
	key, _ := testenv.NewKey()
	rs := make([]*testenv.Relay, n)
	for i := range rs {
		rs[i] = testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: key, Env: env})
	}
	return rs
}

// fanAssertOnce fails unless each id arrived exactly once on s.
func fanAssertOnce(t *testing.T, s *testenv.Sub, where string, ids ...string) {
	t.Helper()
	got := s.Counts()
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("%s: event %s arrived %d times, want 1", where, id[:8], got[id])
		}
	}
}

// Three processes: what is published on any of them (and what psql inserts) reaches subscribers on
// all of them, exactly once; ephemeral events too.
func TestFanoutPublishOnEachReceiveOnAll(t *testing.T) {
	dbURL := testenv.DB(t)
	rs := startFanoutRelays(t, dbURL, 3, nil)
	author := newFanUser()
	var subs []*testenv.Sub
	for _, r := range rs {
		subs = append(subs, testenv.Dial(t, r.URL).Subscribe(nostr.Filter{Authors: []string{author.pk}, Kinds: []int{1, 20001}}))
	}

	var ids []string
	for i, r := range rs {
		pub := testenv.Dial(t, r.URL)
		ev := author.event(1, "from process "+r.InstanceID)
		pub.MustPublish(ev)
		ids = append(ids, ev.ID)
		eph := author.event(20001, "typing on "+r.InstanceID)
		pub.MustPublish(eph)
		ids = append(ids, eph.ID)
		_ = i
	}
	// An operator's insert from SQL reaches live subscribers too.
	op := author.event(1, "inserted from psql")
	fanPsqlAccept(t, dbURL, op)
	ids = append(ids, op.ID)

	for _, s := range subs {
		s.WaitEvents(20*time.Second, ids...)
	}
	// Barrier: a last event published after everything; once it is in, any duplicate of the
	// earlier ones would have arrived (each process delivers in commit order).
	last := author.event(1, "barrier")
	testenv.Dial(t, rs[0].URL).MustPublish(last)
	for i, s := range subs {
		s.WaitEvents(20*time.Second, last.ID)
		fanAssertOnce(t, s, "subscriber on "+rs[i].InstanceID, append(ids, last.ID)...)
	}
}

// Private events keep their read gates across processes: a gift wrap and a DM message published on
// one process reach their reader on another and nobody else.
func TestFanoutPrivateEventsRespectGates(t *testing.T) {
	dbURL := testenv.DB(t)
	rs := startFanoutRelays(t, dbURL, 3, nil)
	alice, bob, eve := newFanUser(), newFanUser(), newFanUser()

	// Bob on process 1, authenticated; Eve on process 2, authenticated as herself; an anonymous
	// subscriber on process 2. All ask, with one filter, for everything Alice publishes of these
	// kinds.
	bobC := testenv.Dial(t, rs[1].URL)
	bobC.Auth(bob.sk)
	eveC := testenv.Dial(t, rs[2].URL)
	eveC.Auth(eve.sk)
	anonC := testenv.Dial(t, rs[2].URL)

	aliceC := testenv.Dial(t, rs[0].URL)
	aliceC.Auth(alice.sk)
	channel := fanOpenDM(t, aliceC, alice, bob.pk)

	filter := nostr.Filter{Authors: []string{alice.pk}, Kinds: []int{1, 9, 1059}}
	bobS := bobC.Subscribe(filter)
	eveS := eveC.Subscribe(filter)
	// The same filter as the authenticated readers': it asks for the gift wrap and the DM message
	// too (a public kind in it keeps the REQ open), so only the live gate keeps them out.
	anonS := anonC.Subscribe(filter)

	gift := alice.event(1059, "sealed for bob", nostr.Tag{"p", bob.pk})
	aliceC.MustPublish(gift)
	dm := alice.event(9, "hi bob", nostr.Tag{"h", channel})
	aliceC.MustPublish(dm)
	// Barrier: a public event committed after the private ones. Each process delivers in commit
	// order, so once a subscriber has it, a leaked private event would have arrived before.
	public := alice.event(1, "public")
	aliceC.MustPublish(public)

	bobS.WaitEvents(20*time.Second, gift.ID, dm.ID, public.ID)
	fanAssertOnce(t, bobS, "bob", gift.ID, dm.ID, public.ID)
	eveS.WaitEvents(20*time.Second, public.ID)
	anonS.WaitEvents(20*time.Second, public.ID)
	for _, x := range []struct {
		s    *testenv.Sub
		name string
	}{{eveS, "eve"}, {anonS, "anonymous"}} {
		got := x.s.Counts()
		if got[gift.ID] != 0 || got[dm.ID] != 0 {
			t.Errorf("I7 broken: %s on another process received a private event (gift %d, dm %d)", x.name, got[gift.ID], got[dm.ID])
		}
	}
}

// Killing the walsender of the subscriber's process while events flow loses and duplicates
// nothing: the process reconnects and backfills from its slot.
func TestFanoutWalsenderKilledAcrossProcesses(t *testing.T) {
	dbURL := testenv.DB(t)
	rs := startFanoutRelays(t, dbURL, 2, nil)
	pool := testenv.Pool(t, dbURL)
	author := newFanUser()
	s := testenv.Dial(t, rs[1].URL).Subscribe(nostr.Filter{Authors: []string{author.pk}})
	pub := testenv.Dial(t, rs[0].URL)

	var ids []string
	kill := func() {
		var pid int
		err := pool.QueryRow(context.Background(),
			`SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND backend_type = 'walsender'`,
			fanout.ApplicationName(rs[1].InstanceID)).Scan(&pid)
		if err != nil {
			t.Fatalf("walsender of %s: %v", rs[1].InstanceID, err)
		}
		if _, err := pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid); err != nil {
			t.Fatal(err)
		}
	}
	for round := 0; round < 4; round++ {
		// Pipeline a burst, kill the walsender in the middle of it, then collect the OKs.
		var burst []*nostr.Event
		for i := 0; i < 100; i++ {
			ev := author.event(1, "flow")
			burst = append(burst, ev)
			pub.SendEvent(ev)
			if i == 30 {
				kill()
			}
		}
		for _, ev := range burst {
			pub.WaitOK(ev.ID, 20*time.Second)
			ids = append(ids, ev.ID)
		}
		s.WaitEvents(30*time.Second, ids...)
	}
	last := author.event(1, "barrier")
	pub.MustPublish(last)
	s.WaitEvents(20*time.Second, last.ID)
	fanAssertOnce(t, s, "subscriber", append(ids, last.ID)...)
}

// kill -9 of one process: its slot is gone within the documented bound while the others keep
// delivering.
func TestFanoutKilledProcessSlotIsReaped(t *testing.T) {
	const stale = 3 * time.Second
	dbURL := testenv.DB(t)
	rs := startFanoutRelays(t, dbURL, 3, map[string]string{"BUZZ_SLOT_STALE_AFTER": stale.String()})
	pool := testenv.Pool(t, dbURL)
	slot := fanout.SlotName(rs[2].InstanceID)
	slotExists := func() bool {
		t.Helper()
		// A failed query fails the test: it must not read as "reaped" and end the loop below.
		return testenv.MustInt(t, pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot) > 0
	}
	if !slotExists() {
		t.Fatalf("slot %s missing while its process runs", slot)
	}
	author := newFanUser()
	s := testenv.Dial(t, rs[1].URL).Subscribe(nostr.Filter{Authors: []string{author.pk}})
	pub := testenv.Dial(t, rs[0].URL)

	killed := time.Now()
	rs[2].Kill()
	var ids []string
	for !func() bool { return !slotExists() }() {
		if time.Since(killed) > 5*stale {
			t.Fatalf("slot %s of the killed process still exists %s after kill -9 (bound: StaleAfter %s + StaleAfter/3)", slot, time.Since(killed), stale)
		}
		ev := author.event(1, "while reaping")
		pub.MustPublish(ev)
		ids = append(ids, ev.ID)
		time.Sleep(100 * time.Millisecond) // pacing of the traffic, not a synchronisation
	}
	gone := time.Since(killed)
	t.Logf("slot of the killed process dropped %s after kill -9 (StaleAfter %s)", gone, stale)
	// Slack on a loaded machine: 3 s for the reaper's own work, and StaleAfter more in case a
	// survivor's failed beats restarted the gap-free run it must have before it reaps.
	if bound := stale + stale/3 + stale/10 + stale + 3*time.Second; gone > bound {
		t.Errorf("slot dropped after %s; documented bound is StaleAfter + StaleAfter/3 (+10%% jitter) = %s, allowed here with slack %s",
			gone, stale+stale/3+stale/10, bound)
	}
	ev := author.event(1, "after reaping")
	pub.MustPublish(ev)
	ids = append(ids, ev.ID)
	s.WaitEvents(20*time.Second, ids...)
	fanAssertOnce(t, s, "subscriber on a surviving process", ids...)
	if testenv.MustInt(t, pool, `SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, rs[2].InstanceID) != 0 {
		t.Errorf("instance row of the killed process survived reaping")
	}
}

// SIGTERM: the process drops its own slot and instance row on the way out, without waiting for a
// reaper.
func TestFanoutGracefulStopDropsSlot(t *testing.T) {
	dbURL := testenv.DB(t)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	pool := testenv.Pool(t, dbURL)
	count := func(q, arg string) int {
		var n int
		if err := pool.QueryRow(context.Background(), q, arg).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	slot := fanout.SlotName(r.InstanceID)
	if count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot) != 1 {
		t.Fatalf("slot %s missing while the process runs", slot)
	}
	r.Stop()
	if n := count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot); n != 0 {
		t.Errorf("slot %s survived a graceful stop", slot)
	}
	if n := count(`SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, r.InstanceID); n != 0 {
		t.Errorf("instance row survived a graceful stop")
	}
}

// Relays cache DM member sets for live delivery. An operator's edit of member rows (a key moved
// after a compromise, a member removed) is announced through the replication stream (0014), and
// takes effect for the next event on every process: the old key gets nothing more. Each step
// ends with a public barrier event: deliveries reach a connection in commit order.
func TestFanoutMemberEditsReachLiveDelivery(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	rs := startFanoutRelays(t, dbURL, 2, nil)
	pool := testenv.Pool(t, dbURL)
	alice, bob, carol := newFanUser(), newFanUser(), newFanUser()
	aliceC := testenv.Dial(t, rs[0].URL)
	aliceC.Auth(alice.sk)
	channel := fanOpenDM(t, aliceC, alice, bob.pk)
	filter := nostr.Filter{Authors: []string{alice.pk}, Kinds: []int{1, 9}}
	bobC, carolC := testenv.Dial(t, rs[1].URL), testenv.Dial(t, rs[1].URL)
	bobC.Auth(bob.sk)
	carolC.Auth(carol.sk)
	bobS, carolS := bobC.Subscribe(filter), carolC.Subscribe(filter)

	step := func(name string, edit string, got, notGot []*testenv.Sub) {
		t.Helper()
		if edit != "" {
			if _, err := pool.Exec(context.Background(), edit, channel, bob.pk, carol.pk); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		dm := alice.event(9, name, nostr.Tag{"h", channel})
		aliceC.MustPublish(dm)
		barrier := alice.event(1, "after "+name)
		aliceC.MustPublish(barrier)
		for _, s := range notGot {
			s.WaitEvents(20*time.Second, barrier.ID)
			if n := s.Counts()[dm.ID]; n != 0 {
				t.Fatalf("%s: a key not in the DM received its message", name)
			}
		}
		for _, s := range got {
			s.WaitEvents(20*time.Second, dm.ID, barrier.ID)
		}
	}
	// Bob's set is cached on process 1 by this delivery.
	step("before any edit", "", []*testenv.Sub{bobS}, []*testenv.Sub{carolS})
	step("bob's key moved to carol", `UPDATE buzz.members SET pubkey = $3 WHERE channel_id = $1::uuid AND pubkey = $2 AND $3 <> ''`,
		[]*testenv.Sub{carolS}, []*testenv.Sub{bobS})
	step("carol removed", `DELETE FROM buzz.members WHERE channel_id = $1::uuid AND pubkey = $3 AND $2 <> ''`,
		nil, []*testenv.Sub{bobS, carolS})
}
