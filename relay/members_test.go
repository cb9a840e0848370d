package relay

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
	dto "github.com/prometheus/client_model/go"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// The member lookups of REQ gates run on the query pool: with every acceptance connection taken,
// a member still gets the answer to a REQ by #h (and a flood of such REQs cannot take the
// connections acceptance needs).
func TestGateLookupsDoNotUseTheAcceptancePool(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.memberWait = 2 * time.Second
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk)
	msg := signed(a.sk, 9, "hello", nostr.Now(), nostr.Tag{"h", ch})
	a.c.mustPublish(msg)

	defer holdAll(t, tr.s.accept)()
	got, closed := b.c.reqOrClosed("h", nostr.Filter{Tags: nostr.TagMap{"h": {ch}}, Kinds: []int{9}})
	if closed != "" {
		t.Fatalf("REQ by #h closed while the acceptance pool was busy: %q", closed)
	}
	sameIDs(t, "member", got, msg)
}

// A member-set lookup for live delivery that fails is retried, not dropped: buzz.members is locked
// by another session past the lookup's wait, the lookup fails, the lock goes, and the member's live
// subscription still receives the event. The relay never delivers a gated event unchecked.
func TestDeliveryRetriesAFailedMemberLookup(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.memberWait = 200 * time.Millisecond
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk) // no #h REQ below, so the member set is not cached yet
	f := nostr.Filter{Authors: []string{a.pk}, Kinds: []int{9}}
	b.c.req("live", f)

	ctx := context.Background()
	locker, err := tr.s.query.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(ctx) }()
	if _, err := locker.Exec(ctx, `LOCK TABLE buzz.members IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	retried := lookupRetries(tr)
	m := signed(a.sk, 9, "while members are locked", nostr.Now(), nostr.Tag{"h", ch})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
	}()
	select {
	case <-retried:
	case <-done:
		t.Fatal("Deliver returned while the member lookup could not run")
	case <-time.After(30 * time.Second):
		t.Fatal("the member lookup never failed although buzz.members was locked")
	}
	if err := locker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Deliver did not finish after the lock was released")
	}
	if got := b.c.nextEvent("live"); got.ID != m.ID {
		t.Fatalf("member got %s, want %s", got.ID, m.ID)
	}
	var mv dto.Metric
	if err := metrics.MemberLookupRetries.Write(&mv); err != nil || mv.GetCounter().GetValue() < 1 {
		t.Fatalf("buzz_member_lookup_retries_total = %v (%v)", mv.GetCounter().GetValue(), err)
	}
}

// A lookup that read before an announced member edit must not cache what it read: it may be the
// set the edit replaced.
func TestMemberCacheForgetsAndSkipsStaleReads(t *testing.T) {
	mc := newMemberCache(4, nil)
	const ch = "5f0c0c9e-7d4e-4b8e-9d3c-0e6a4f1b2c3d"
	mc.put(ch, []string{"alice", "bob"}, mc.currentEpoch())
	if _, ok := mc.get(ch); !ok {
		t.Fatal("set not cached")
	}
	readAt := mc.currentEpoch()
	mc.forget(evt.MembersChange{Channels: []string{ch}}, 0)
	if _, ok := mc.get(ch); ok {
		t.Fatal("set still cached after its edit was announced")
	}
	mc.put(ch, []string{"alice", "bob"}, readAt) // read before the forget, put after it
	if _, ok := mc.get(ch); ok {
		t.Fatal("a read from before the edit was cached")
	}
	mc.put(ch, []string{"alice", "carol"}, mc.currentEpoch())
	mc.forget(evt.MembersChange{All: true}, 0)
	if _, ok := mc.get(ch); ok {
		t.Fatal("set still cached after a truncate was announced")
	}
}

// Lookups run side by side (REQ gates on many connections): one whose snapshot is older may
// finish after a newer one saw an edit and stopped waiting for it. The older one must not count.
// One transaction announcing many statements is waited for once.
func TestPendingForgetCountsOnlyForSnapshotsThatSeeIt(t *testing.T) {
	mc := newMemberCache(4, nil)
	const ch = "5f0c0c9e-7d4e-4b8e-9d3c-0e6a4f1b2c3d"
	mc.forget(evt.MembersChange{Channels: []string{ch}}, 100)
	mc.forget(evt.MembersChange{Channels: []string{ch}}, 100)
	if n := mc.pendingCount(); n != 1 {
		t.Fatalf("%d pending for one transaction, want 1", n)
	}
	_, beganOlder := mc.begin()
	_, beganNewer := mc.begin()
	older := &mvccSnapshot{xmin: 100, xmax: 101, xip: []uint64{100}}
	newer := &mvccSnapshot{xmin: 101, xmax: 101}
	if !mc.sawForgets(newer, beganNewer) {
		t.Fatal("a snapshot that sees the edit did not count")
	}
	if n := mc.pendingCount(); n != 0 {
		t.Fatalf("%d still pending after a snapshot saw the edit", n)
	}
	if mc.sawForgets(older, beganOlder) {
		t.Fatal("a lookup whose snapshot missed the edit counted because a newer one had seen it")
	}
}

// A pending edit keeps the full transaction id its first check placed it at: a process that
// looks up nothing while 2^31 more transactions start must not read its low 32 bits as a future
// transaction and wait for it for good.
func TestPendingForgetKeepsItsPlace(t *testing.T) {
	mc := newMemberCache(4, nil)
	const full = uint64(5)<<32 + 100
	mc.forget(evt.MembersChange{All: true}, uint32(full&0xffffffff))
	_, began := mc.begin()
	if mc.sawForgets(&mvccSnapshot{xmin: full, xmax: full + 1, xip: []uint64{full}}, began) {
		t.Fatal("a snapshot with the edit's transaction running counted")
	}
	later := uint64(1)<<31 + 20
	_, began = mc.begin()
	if !mc.sawForgets(&mvccSnapshot{xmin: full + later - 10, xmax: full + later}, began) {
		t.Fatal("a snapshot 2^31 transactions later does not see the edit")
	}
}

// Live delivery's member lookups run on their own pool: with every acceptance connection taken
// (a flood of EVENTs), a DM message not seen before still reaches its member's subscription.
func TestDeliveryLookupsDoNotUseTheAcceptancePool(t *testing.T) {
	tr, _ := relayWithLookupPool(t)
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk) // the member set is not cached yet
	b.c.req("live", nostr.Filter{Authors: []string{a.pk}, Kinds: []int{9}})
	retried := lookupRetries(tr)

	var once sync.Once
	held := holdAll(t, tr.s.accept)
	release := func() { once.Do(held) }
	defer release()
	m := signed(a.sk, 9, "while acceptance is busy", nostr.Now(), nostr.Tag{"h", ch})
	done := testenv.Async(func() {
		tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
	})
	select {
	case <-done:
	case <-retried:
		release() // let the retried lookup through, or Deliver would wait for good
		<-done
		t.Fatal("the member lookup waited for an acceptance connection")
	}
	if got := b.c.nextEvent("live"); got.ID != m.ID {
		t.Fatalf("live event %s, want %s", got.ID, m.ID)
	}
}

// A DM event that no subscription here matches costs no member lookup: with the lookup pool
// held, Deliver returns without waiting for one. Then a matching subscription does make it look
// up (so the first half is not passing for want of a lookup to make).
func TestDeliveryLooksUpMembersOnlyForAMatch(t *testing.T) {
	tr, lookup := relayWithLookupPool(t)
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk) // not cached yet
	b.c.req("reactions", nostr.Filter{Kinds: []int{7}})
	looked := lookupRetries(tr)
	var once sync.Once
	held := holdAll(t, lookup)
	release := func() { once.Do(held) }
	defer release()
	deliver := func(m nostr.Event) <-chan struct{} {
		return testenv.Async(func() {
			tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
		})
	}

	done := deliver(signed(a.sk, 9, "nobody here subscribes to this", nostr.Now(), nostr.Tag{"h", ch}))
	select {
	case <-done:
	case <-looked:
		release()
		<-done
		t.Fatal("Deliver looked up the members of a DM no subscription matches")
	}

	b.c.req("live", nostr.Filter{Authors: []string{a.pk}, Kinds: []int{9}})
	m := signed(a.sk, 9, "b subscribes to this", nostr.Now(), nostr.Tag{"h", ch})
	done = deliver(m)
	select {
	case <-looked:
		release()
	case <-done:
		t.Fatal("Deliver returned without a member lookup while a subscription matched")
	}
	<-done
	if got := b.c.nextEvent("live"); got.ID != m.ID {
		t.Fatalf("live event %s, want %s", got.ID, m.ID)
	}
}

// A member edit's forget arrives (decoded) before other sessions can see the edit, and a lookup
// right then would read the old set. It reads again until its snapshot sees the edit: a member
// removed by an operator does not get the DM's next message. The open transaction stands for that
// moment.
func TestMemberLookupWaitsForAnAnnouncedEdit(t *testing.T) {
	tr := startRelay(t, nil)
	ctx := context.Background()
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk)
	a.c.req("live", nostr.Filter{Kinds: []int{9}})
	b.c.req("live", nostr.Filter{Kinds: []int{9}})

	tx, err := tr.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var xid int64
	if err := tx.QueryRow(ctx, `DELETE FROM buzz.members WHERE channel_id = $1::uuid AND pubkey = $2 RETURNING pg_current_xact_id()::text::bigint`, ch, b.pk).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	stale := make(chan struct{})
	var once sync.Once
	defer hooks.Set("relay.members.stale", func(context.Context) { once.Do(func() { close(stale) }) })()
	tr.s.MembersChanged(evt.MembersChange{Channels: []string{ch}, Xid: uint32(xid)})

	m := signed(a.sk, 9, "after b was removed", nostr.Now(), nostr.Tag{"h", ch})
	done := testenv.Async(func() {
		tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
	})
	select {
	case <-stale:
	case <-done:
		t.Fatal("Deliver used a member set read before the announced removal was visible")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	if got := a.c.nextEvent("live"); got.ID != m.ID {
		t.Fatalf("a got %s, want %s", got.ID, m.ID)
	}
	syncNone(t, b.c, "live")
}

// A synchronous standby that does not answer keeps a member edit's commit invisible for as long
// as it stalls, while logical decoding has already sent it. Member lookups wait all that time
// (fail closed): past the 10 s after which an announced edit used to be taken as visible, the
// removed member still gets nothing, and once the edit is visible the next message goes to the
// new set, so no set read meanwhile stayed cached. The open transaction stands for the stalled
// commit, and a clock moved 11 s forward for the stall's length.
func TestMemberLookupWaitsWhileAnEditStaysInvisible(t *testing.T) {
	var skew atomic.Int64
	realNow := timeNow
	timeNow = func() time.Time { return realNow().Add(time.Duration(skew.Load())) }
	t.Cleanup(func() { timeNow = realNow }) // registered first: runs after the relay has stopped
	var logs testenv.LogBuf
	tr := startRelay(t, func(c *Config) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	ctx := context.Background()
	a := newParty(t, tr, true)
	b := newParty(t, tr, true)
	ch := openDM(t, a, b.pk)
	a.c.req("live", nostr.Filter{Kinds: []int{9}})
	b.c.req("live", nostr.Filter{Kinds: []int{9}})

	tx, err := tr.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var xid int64
	if err := tx.QueryRow(ctx, `DELETE FROM buzz.members WHERE channel_id = $1::uuid AND pubkey = $2 RETURNING pg_current_xact_id()::text::bigint`, ch, b.pk).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	var stale atomic.Int64
	staleAgain := make(chan struct{}, 1)
	defer hooks.Set("relay.members.stale", func(context.Context) {
		stale.Add(1)
		select {
		case staleAgain <- struct{}{}:
		default:
		}
	})()
	tr.s.MembersChanged(evt.MembersChange{Channels: []string{ch}, Xid: uint32(xid)})

	m := signed(a.sk, 9, "after b was removed", nostr.Now(), nostr.Tag{"h", ch})
	done := testenv.Async(func() {
		tr.s.DeliverEvent(evt.Delivery{Event: &m, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
	})
	staleReads := func(n int64) {
		t.Helper()
		for stale.Load() < n {
			select {
			case <-staleAgain:
			case <-done:
				t.Fatalf("Deliver used a member set read while the announced removal was invisible (clock +%s)", time.Duration(skew.Load()))
			}
		}
	}
	staleReads(1)
	skew.Store(int64(11 * time.Second))
	// The first stale read counted now may have checked before the clock moved; the second came
	// after it.
	staleReads(stale.Load() + 2)

	var g dto.Metric
	if err := metrics.MemberEditUnseenSeconds.Write(&g); err != nil || g.GetGauge().GetValue() <= 10 {
		t.Errorf("buzz_member_edit_unseen_seconds = %v (%v), want over 10", g.GetGauge().GetValue(), err)
	}
	if out := logs.String(); !strings.Contains(out, "xid="+strconv.FormatInt(xid&0xffffffff, 10)) || !strings.Contains(out, "waited=11s") {
		t.Errorf("no warning naming the unseen edit's xid and its wait; log:\n%s", out)
	}

	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-done
	if got := a.c.nextEvent("live"); got.ID != m.ID {
		t.Fatalf("a got %s, want %s", got.ID, m.ID)
	}
	syncNone(t, b.c, "live")
	if set, ok := tr.s.members.get(ch); !ok || !slices.Equal(set, []string{a.pk}) {
		t.Fatalf("cached set %v (cached: %v), want only a", set, ok)
	}
	m2 := signed(a.sk, 9, "later", nostr.Now(), nostr.Tag{"h", ch})
	tr.s.DeliverEvent(evt.Delivery{Event: &m2, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ch}})
	if got := a.c.nextEvent("live"); got.ID != m2.ID {
		t.Fatalf("a got %s, want %s", got.ID, m2.ID)
	}
	syncNone(t, b.c, "live")
	if tr.s.members.pendingCount() != 0 {
		t.Fatal("the edit is still pending after a lookup saw it")
	}
}

func (mc *memberCache) pendingCount() int {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return len(mc.pending)
}

// relayWithLookupPool starts a relay whose live-delivery member lookups use a pool of their own
// (2 connections) and give up after 200 ms (then retry).
func relayWithLookupPool(t *testing.T) (*testRelay, *pgxpool.Pool) {
	t.Helper()
	tr := startRelay(t, nil)
	tr.s.memberWait = 200 * time.Millisecond
	lookup, err := db.NewPool(context.Background(), testenv.DB(t), "buzzpg-lookup:test", 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(lookup.Close)
	tr.s.SetLookupPool(lookup)
	return tr, lookup
}

// lookupRetries signals (without blocking) each time live delivery retries a member lookup.
func lookupRetries(tr *testRelay) <-chan struct{} {
	ch := make(chan struct{}, 1)
	tr.s.onLookupRetry = func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	return ch
}

// An announced member edit does not hold up live delivery while the lookup pool cannot answer:
// the check of pending edits runs beside it. With every lookup connection taken and the lookup
// wait at a minute, the announcement returns and a public event still reaches its subscriber;
// once the pool is free the edit, which a snapshot can see, stops being pending.
func TestMemberEditAnnouncementDoesNotWaitForTheLookupPool(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.memberWait = time.Minute
	settled := make(chan struct{}, 16)
	tr.s.onSettled = func() { settled <- struct{}{} }
	ctx := context.Background()
	xids := make([]int64, 3) // committed on return: any later snapshot sees them
	for i := range xids {
		if err := tr.pool.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&xids[i]); err != nil {
			t.Fatal(err)
		}
	}
	sub := tr.dial(t)
	sub.req("live", nostr.Filter{Kinds: []int{1}})

	release := holdAll(t, tr.s.lookup)
	defer release()
	done := testenv.Async(func() {
		for i, xid := range xids { // a bulk edit: each announcement used to wait on its own check
			ch := fmt.Sprintf("00000000-0000-4000-8000-%012d", i)
			tr.s.MembersChanged(evt.MembersChange{Channels: []string{ch}, Xid: uint32(xid)})
		}
		ev := signed(nostr.GeneratePrivateKey(), 1, "public, after the edits", nostr.Now())
		tr.s.DeliverEvent(publicDelivery(&ev))
	})
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("live delivery waited for the check of announced edits while the lookup pool was taken")
	}
	if got := sub.nextEvent("live"); got.Content != "public, after the edits" {
		t.Fatalf("subscriber got %q", got.Content)
	}
	select {
	case <-settled:
		t.Fatal("the check finished while the lookup pool was taken")
	default:
	}
	release()
	select {
	case <-settled:
	case <-time.After(30 * time.Second):
		t.Fatal("the check of announced edits never ran once the pool was free")
	}
	if n := tr.s.members.pendingCount(); n != 0 {
		t.Errorf("%d committed edits still pending after the check", n)
	}
}
