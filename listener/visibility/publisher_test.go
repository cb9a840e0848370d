package visibility

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// 1. Accepted change → publication fails → that publisher stops → a new one recovers it by itself,
// without the triggering event being replayed.
func TestSnapshotRecoversAfterFailedPublication(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, viewer := testenv.NewKey()
	senderSK, senderPK := testenv.NewKey()
	var x string
	if err := e.pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`,
		senderPK, viewer).Scan(&x); err != nil {
		t.Fatal(err)
	}
	y, _ := e.dm(viewer)
	e.hide(viewer, x)
	e.hide(viewer, y)

	a := e.publisher("A", nil)
	stopA := e.start(a)
	e.waitConverged([]string{viewer}, 10*time.Second)

	// From now on every snapshot insert fails.
	e.exec(`CREATE FUNCTION public.fail_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: snapshot storage down'; END $$;
		CREATE TRIGGER fail_snapshots BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.fail_snapshots();`)

	// A resurfacing message, accepted: X comes back for the viewer (the hide is cleared and the
	// generation bumped in the message's transaction).
	before := e.gens(viewer)
	msg := &nostr.Event{Kind: 9, CreatedAt: nostr.Now(), Tags: nostr.Tags{{"h", x}}, Content: "ping"}
	if err := msg.Sign(senderSK); err != nil {
		t.Fatal(err)
	}
	ok, verdict, err := store.Accept(ctx, e.pool, msg)
	if err != nil || !ok {
		t.Fatalf("accept resurfacing message: ok=%v %q %v", ok, verdict, err)
	}
	if g := e.gens(viewer); g.target != before.target+1 {
		t.Fatalf("resurfacing did not bump the generation: %+v -> %+v", before, g)
	}
	testenv.WaitUntil(t, 10*time.Second, "publication failing twice", func() bool {
		return testenv.MustInt(t, e.pool, `SELECT coalesce(max(attempts), 0) FROM buzz.visibility_outbox WHERE viewer = $1`, viewer) >= 2
	})

	// The operator view shows it.
	var pending, inBackoff int64
	var worst *string
	if err := e.pool.QueryRow(ctx, `SELECT pending_viewers, in_backoff, worst_error FROM buzz.visibility_lag()`).
		Scan(&pending, &inBackoff, &worst); err != nil {
		t.Fatal(err)
	}
	if pending != 1 || inBackoff != 1 || worst == nil || !strings.Contains(*worst, "snapshot storage down") {
		t.Fatalf("visibility_lag: pending %d, in backoff %d, worst error %v", pending, inBackoff, worst)
	}
	stopA()
	if a.counters().Failed == 0 {
		t.Fatal("publisher A never failed")
	}
	if g := e.gens(viewer); g.published != before.published {
		t.Fatalf("published moved while failing: %+v", g)
	}

	// Storage is back; a new publisher (a "restart") converges without any replay.
	e.exec(`DROP TRIGGER fail_snapshots ON buzz.events`)
	b := e.publisher("B", nil)
	e.start(b)
	e.waitConverged([]string{viewer}, 10*time.Second)
	if _, hs := e.head(viewer); !slices.Equal(hs, []string{y}) {
		t.Fatalf("snapshot %v, want [%s] (x resurfaced)", hs, y)
	}
	if testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1`, viewer) != 0 {
		t.Fatalf("outbox row left behind")
	}
	e.assertAuditMonotonic()
}

// 2. A publisher paused between its read and the fence, holding generation g with {X}, loses to
// the newer g+1 = {}: it comes back 'stale' and the head stays {} at g+1.
// "later-clock" variant: B's snapshot carries a smaller created_at than A's (B read the clock
// before a step back, say), so only the generation fence can stop A (the created_at check cannot).
func TestSnapshotPausedStalePublisherIsFenced(t *testing.T) {
	for _, variant := range []string{"same-clock", "later-clock"} {
		t.Run(variant, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			_, viewer := testenv.NewKey()
			x, _ := e.dm(viewer)
			// An earlier head well below the clock, so B can publish above it yet below A.
			e.exec(`SELECT buzz.bump_visibility($1)`, viewer)
			g0 := e.gens(viewer).target
			early := e.dbNow() - 30
			if out, err := PublishSigned(ctx, e.pool, viewer, g0, signedSnapshot(t, e.sk, viewer, nil, early)); err != nil || out != OutcomePublished {
				t.Fatalf("initial head: %q %v", out, err)
			}

			e.hide(viewer, x) // g = {X}
			g := e.gens(viewer).target
			_, gateA, resA := e.pausedPublisher("A", viewer) // A holds g with {X}

			e.unhide(viewer, x) // g+1 = {}
			if variant == "same-clock" {
				b := e.publisher("B", nil)
				if out, err := b.PublishViewer(ctx, viewer); err != nil || out != OutcomePublished {
					t.Fatalf("B: %q %v", out, err)
				}
			} else {
				src, err := ReadSource(ctx, e.pool, viewer)
				if err != nil || src.Generation != g+1 {
					t.Fatalf("source %+v %v", src, err)
				}
				ev := signedSnapshot(t, e.sk, viewer, src.Hidden, early+1) // below A's created_at
				if out, err := PublishSigned(ctx, e.pool, viewer, src.Generation, ev); err != nil || out != OutcomePublished {
					t.Fatalf("B: %q %v", out, err)
				}
			}
			headB, _ := e.head(viewer)

			gateA.Open()
			r := <-resA
			if r.err != nil || r.out != OutcomeStale {
				t.Fatalf("A after resume: %q %v, want stale", r.out, r.err)
			}
			gp := e.gens(viewer)
			if gp.published != g+1 || gp.target != g+1 {
				t.Fatalf("generations %+v, want %d published", gp, g+1)
			}
			head, hs := e.head(viewer)
			if head.ID != headB.ID || len(hs) != 0 {
				t.Fatalf("head %s %v, want B's %s with nothing hidden", short(head.ID), hs, short(headB.ID))
			}
			e.assertConverged(viewer)
			e.assertAuditMonotonic()
		})
	}
}

// 5. Equal-second publications: the later generation still wins with a strictly greater
// created_at. The head is set a few seconds ahead of the clock, so both publishers compute the
// same created_at = floor + 1 deterministically, whatever second the test runs in.
func TestSnapshotEqualSecondLaterGenerationWins(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, viewer := testenv.NewKey()
	x, _ := e.dm(viewer)
	e.exec(`SELECT buzz.bump_visibility($1)`, viewer)
	floor := e.dbNow() + 5
	if out, err := PublishSigned(ctx, e.pool, viewer, e.gens(viewer).target, signedSnapshot(t, e.sk, viewer, nil, floor)); err != nil || out != OutcomePublished {
		t.Fatalf("initial head: %q %v", out, err)
	}

	e.hide(viewer, x) // g = {X}
	g := e.gens(viewer).target
	older := e.publisher("older", nil)
	gOld := pauseAt(t, HookBeforeFence, "older")
	oldDone := make(chan string, 1)
	go func() { o, _ := older.PublishViewer(ctx, viewer); oldDone <- o }()
	gOld.Wait(t) // holds g, created_at floor+1

	e.unhide(viewer, x) // g+1 = {}
	newer := e.publisher("newer", nil)
	// The newer generation reads now (same floor, so the same created_at) and is built; the
	// older one publishes first.
	src, err := ReadSource(ctx, e.pool, viewer)
	if err != nil {
		t.Fatal(err)
	}
	created, _ := src.CreatedAt()
	if created != floor+1 || src.Generation != g+1 {
		t.Fatalf("newer read %+v created %d, want g %d created %d", src, created, g+1, floor+1)
	}
	evNew := signedSnapshot(t, e.sk, viewer, src.Hidden, created)

	gOld.Open()
	if o := <-oldDone; o != OutcomePublished {
		t.Fatalf("older generation: %q, want published (it was still the newest published)", o)
	}
	oldHead, _ := e.head(viewer)
	if int64(oldHead.CreatedAt) != floor+1 {
		t.Fatalf("older head created_at %d, want %d", oldHead.CreatedAt, floor+1)
	}
	// The newer generation, built in the same second, is told to retry...
	out, err := PublishSigned(ctx, e.pool, viewer, src.Generation, evNew)
	if err != nil || out != OutcomeRetry {
		t.Fatalf("equal created_at: %q %v, want retry", out, err)
	}
	// ...and a publisher, re-reading, wins with a strictly greater created_at.
	if o, err := newer.PublishViewer(ctx, viewer); err != nil || o != OutcomePublished {
		t.Fatalf("newer: %q %v", o, err)
	}
	head, hs := e.head(viewer)
	if head.CreatedAt <= oldHead.CreatedAt || len(hs) != 0 {
		t.Fatalf("head created_at %d (older %d), hidden %v", head.CreatedAt, oldHead.CreatedAt, hs)
	}
	e.assertConverged(viewer)
	if n := e.assertAuditMonotonic(); n != 3 {
		t.Fatalf("%d publications, want 3", n)
	}
}

// 3. Two publishers over 1,000 dirty viewers: all converge, no generation published twice, none
// regresses (audit trigger), created_at strictly rises.
func TestSnapshotTwoPublishersThousandViewers(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const n = 1000
	viewers := make([]string, n)
	for i := range viewers {
		_, viewers[i] = testenv.NewKey()
	}
	// Each viewer gets one DM hidden, in bulk (one DM per viewer with a shared other party).
	_, other := testenv.NewKey()
	t0 := time.Now()
	e.exec(`SELECT buzz.hide_dm(v, (buzz.open_dm(v, ARRAY[$2], NULL)).channel_id) FROM unnest($1::text[]) v`, viewers, other)
	t.Logf("setup %s", time.Since(t0))
	a := e.publisher("A", func(c *Config) { c.BatchSize = 50 })
	b := e.publisher("B", func(c *Config) { c.BatchSize = 50 })
	e.start(a)
	e.start(b)
	// More changes while both run: unhide half of them again.
	e.exec(`SELECT buzz.unhide_dm(m.pubkey, m.channel_id) FROM buzz.members m
	         WHERE m.pubkey = ANY($1::text[]) AND m.hidden_at IS NOT NULL`, viewers[:n/2])
	t0 = time.Now()
	e.waitConverged(viewers, 60*time.Second)
	t.Logf("converged in %s", time.Since(t0))
	pubs := e.assertAuditMonotonic()
	sa, sb := a.counters(), b.counters()
	t.Logf("publications %d; A %+v; B %+v", pubs, sa, sb)
	if sa.Published == 0 || sb.Published == 0 {
		t.Fatalf("both publishers should have shared the work: A %d, B %d", sa.Published, sb.Published)
	}
	if left := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox`); left != 0 {
		t.Fatalf("%d outbox rows left", left)
	}

	// Contention: every viewer changes again while, besides both running publishers, one
	// goroutine per publisher publishes every viewer directly (no claims), in opposite orders, so
	// the same generations are raced for and only the database fence decides.
	e.exec(`SELECT buzz.hide_dm(m.pubkey, m.channel_id) FROM buzz.members m
	         WHERE m.pubkey = ANY($1::text[]) AND m.hidden_at IS NULL`, viewers[:n/2])
	var wg sync.WaitGroup
	for i, p := range []*Publisher{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range viewers {
				v := viewers[j]
				if i == 1 {
					v = viewers[n-1-j]
				}
				if _, err := p.PublishViewer(ctx, v); err != nil {
					t.Errorf("PublishViewer: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	e.waitConverged(viewers, 60*time.Second)
	pubs2 := e.assertAuditMonotonic()
	sa, sb = a.counters(), b.counters()
	t.Logf("after the race: publications %d; A %+v; B %+v", pubs2, sa, sb)
	if sa.Stale+sb.Stale+sa.Retry+sb.Retry == 0 {
		t.Fatal("the race never hit the fence")
	}
}

// 4a. The LISTEN connection is killed while work arrives; the periodic sweep is off (1h), so only
// the sweep after the reconnect can find work committed while nobody listened.
func TestSnapshotListenConnectionKilled(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := e.publisher("L", nil)
	e.start(p)
	gate := pauseAt(t, HookListenReconnect, "")

	var viewers []string
	hideOne := func() {
		_, v := testenv.NewKey()
		ch, _ := e.dm(v)
		e.hide(v, ch)
		viewers = append(viewers, v)
	}
	hideOne()
	var killed int
	if err := e.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1`, ListenAppName("L")).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminate LISTEN backend: %d %v", killed, err)
	}
	gate.Wait(t) // the publisher noticed and waits to reconnect: nobody listens now
	for i := 0; i < 20; i++ {
		hideOne()
	}
	gate.Open()
	e.waitConverged(viewers, 20*time.Second)
	if s := p.counters(); s.ListenConnects < 2 {
		t.Fatalf("LISTEN connects %d, want a reconnect", s.ListenConnects)
	}
}

// 4b. Work that arrived while no listener ran at all (including an outbox row that was lost)
// converges through the start-up sweep.
func TestSnapshotBacklogWithoutListener(t *testing.T) {
	e := newEnv(t)
	var viewers []string
	for i := 0; i < 30; i++ {
		_, v := testenv.NewKey()
		ch, _ := e.dm(v)
		e.hide(v, ch)
		viewers = append(viewers, v)
	}
	// Lose some queue rows: the state still says they are pending.
	e.exec(`DELETE FROM buzz.visibility_outbox WHERE viewer = ANY($1)`, viewers[:10])
	p := e.publisher("late", nil)
	e.start(p)
	e.waitConverged(viewers, 20*time.Second)
	if s := p.counters(); s.Repaired < 10 {
		t.Fatalf("sweep repaired %d rows, want >= 10", s.Repaired)
	}
}

// 6. A hide from psql (buzz.hide_dm) and a raw UPDATE of members.hidden_at both converge, with no
// relay involved.
func TestSnapshotSQLHidesConverge(t *testing.T) {
	e := newEnv(t)
	p := e.publisher("sql", func(c *Config) { c.SweepInterval = 50 * time.Millisecond })
	e.start(p)
	viewer, x, y := e.viewerWithTwoDMs()
	e.exec(`SELECT buzz.hide_dm($1, $2::uuid)`, viewer, x)
	e.waitConverged([]string{viewer}, 10*time.Second)
	if _, hs := e.head(viewer); !slices.Equal(hs, []string{x}) {
		t.Fatalf("after hide_dm: %v", hs)
	}
	e.exec(`UPDATE buzz.members SET hidden_at = now() WHERE channel_id = $1::uuid AND pubkey = $2`, y, viewer)
	e.waitConverged([]string{viewer}, 10*time.Second)
	want := []string{x, y}
	slices.Sort(want)
	if _, hs := e.head(viewer); !slices.Equal(hs, want) {
		t.Fatalf("after raw UPDATE: %v, want %v", hs, want)
	}
	e.assertAuditMonotonic()
}

// 7. Key rotation: a snapshot by K1 (ahead of the clock) exists; publishing with K2 removes it,
// and K2's created_at is above K1's.
func TestSnapshotKeyRotation(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	viewer, x := e.hiddenViewer()
	k1 := e.dbNow() + 4
	if out, err := PublishSigned(ctx, e.pool, viewer, e.gens(viewer).target, signedSnapshot(t, e.sk, viewer, []string{x}, k1)); err != nil || out != OutcomePublished {
		t.Fatalf("K1 snapshot: %q %v", out, err)
	}
	sk2, pk2 := testenv.NewKey()
	e.setRelayKey(pk2)
	e.sk = sk2
	e.unhide(viewer, x)
	p := e.publisher("k2", nil)
	if out, err := p.PublishViewer(ctx, viewer); err != nil || out != OutcomePublished {
		t.Fatalf("K2: %q %v", out, err)
	}
	head, hs := e.head(viewer) // fails if K1's is still there
	if head.PubKey != pk2 || int64(head.CreatedAt) <= k1 || len(hs) != 0 {
		t.Fatalf("head by %s at %d (K1 at %d), hidden %v", short(head.PubKey), head.CreatedAt, k1, hs)
	}
	// A snapshot by a key other than the configured relay key is refused.
	e.hide(viewer, x)
	src, _ := ReadSource(ctx, e.pool, viewer)
	created, _ := src.CreatedAt()
	sk3, _ := testenv.NewKey()
	if _, err := PublishSigned(ctx, e.pool, viewer, src.Generation, signedSnapshot(t, sk3, viewer, src.Hidden, created)); err == nil {
		t.Fatal("snapshot by a foreign key accepted")
	}
}

// Claims: fresh work is not starved by rows that keep failing; expired leases are re-taken; a
// graceful Close gives claims back at once.
func TestSnapshotClaimsFairnessAndLeases(t *testing.T) {
	e := newEnv(t)
	mk := func(n int) []string {
		var vs []string
		for i := 0; i < n; i++ {
			_, v := testenv.NewKey()
			e.exec(`SELECT buzz.bump_visibility($1)`, v)
			vs = append(vs, v)
		}
		return vs
	}
	poison := mk(40)
	e.exec(`UPDATE buzz.visibility_outbox SET attempts = 5, available_at = now() - interval '1 hour'
	         WHERE viewer = ANY($1)`, poison)
	fresh := mk(5)
	claim := func(max int, lease string) []string {
		t.Helper()
		return testenv.MustColumn[string](t, e.pool, `SELECT viewer FROM buzz.claim_visibility_work(gen_random_uuid(), $1, $2::interval)`, max, lease)
	}
	got := claim(8, "1 hour")
	nFresh := 0
	for _, v := range got {
		if slices.Contains(fresh, v) {
			nFresh++
		}
	}
	if nFresh != 5 || len(got) != 7 {
		t.Fatalf("claimed %d rows with %d fresh; want all 5 fresh plus 2 failing", len(got), nFresh)
	}
	// Expired lease: claim with a lease that is already over, then someone else takes it.
	e.exec(`UPDATE buzz.visibility_outbox SET claim_id = NULL, lease_until = NULL, attempts = 0`)
	first := claim(1000, "0 seconds")
	second := claim(1000, "1 hour")
	if len(first) != 45 || len(second) != 45 {
		t.Fatalf("expired leases not re-taken: %d then %d", len(first), len(second))
	}

	// Graceful Close: A holds a claim (paused before its fence); Close releases it; B publishes.
	e2 := newEnv(t)
	_, viewer := testenv.NewKey()
	ch, _ := e2.dm(viewer)
	gate := pauseAt(t, HookBeforeFence, "A")
	a := e2.publisher("A", nil)
	stopA := e2.start(a)
	e2.hide(viewer, ch)
	gate.Wait(t)
	const claimedRows = `SELECT count(*) FROM buzz.visibility_outbox WHERE claim_id IS NOT NULL`
	if claimed := testenv.MustInt(t, e2.pool, claimedRows); claimed != 1 {
		t.Fatalf("claimed rows %d", claimed)
	}
	stopA() // cancels A (its hook returns on ctx end) and releases its claim
	if testenv.MustInt(t, e2.pool, claimedRows) != 0 {
		t.Fatalf("claim not released on Close")
	}
	b := e2.publisher("B", nil) // lease 30s: only the release lets B in this fast
	e2.start(b)
	e2.waitConverged([]string{viewer}, 5*time.Second)
}

// Shape validation of publish_visibility_snapshot (BZ400).
func TestSnapshotShapeRejected(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	_, viewer := testenv.NewKey()
	_, other := testenv.NewKey()
	e.exec(`SELECT buzz.bump_visibility($1)`, viewer)
	now := e.dbNow()
	cases := map[string]*nostr.Event{}
	ev := signedSnapshot(t, e.sk, other, nil, now) // d = p = someone else
	cases["other viewer"] = ev
	ev2 := BuildSnapshot(viewer, nil, now)
	ev2.Kind = 30623
	_ = ev2.Sign(e.sk)
	cases["kind"] = ev2
	ev3 := BuildSnapshot(viewer, []string{"not-a-uuid"}, now)
	_ = ev3.Sign(e.sk)
	cases["h"] = ev3
	for name, ev := range cases {
		_, err := PublishSigned(ctx, e.pool, viewer, 1, ev)
		if err == nil || !strings.Contains(err.Error(), "BZ400") && !strings.Contains(err.Error(), "invalid") {
			t.Errorf("%s: %v, want BZ400", name, err)
		}
	}
	// Too far ahead of the database clock: 'retry', nothing changes.
	out, err := PublishSigned(ctx, e.pool, viewer, 1, signedSnapshot(t, e.sk, viewer, nil, now+60))
	if err != nil || out != OutcomeRetry {
		t.Fatalf("far ahead: %q %v", out, err)
	}
	if g := e.gens(viewer); g.published != 0 {
		t.Fatalf("published moved: %+v", g)
	}
}
