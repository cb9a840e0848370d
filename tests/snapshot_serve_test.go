package tests

// NIP-DV black-box tests against real `buzzpg serve` processes (I2, I3, I4).

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/visibility"
)

// openDM opens a DM between the client's user and other over the relay and returns its id.
func snapOpenDM(t testing.TB, c *testenv.Client, sk, other string) string {
	t.Helper()
	msg := c.MustPublish(snapEvent(t, sk, 41010, "", nostr.Tag{"p", other}))
	var resp struct {
		ChannelID string `json:"channel_id"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp); err != nil || resp.ChannelID == "" {
		t.Fatalf("open DM: %q", msg)
	}
	return resp.ChannelID
}

// 1 (serve variant). A resurfacing message is accepted over the relay; publication fails; that
// process stops; a new process converges without any replay, and the viewer's live subscription
// (on the new process) receives the new snapshot.
func TestSnapshotServeRecoveryAfterFailedPublication(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	relayKey, relayPK := testenv.NewKey()
	env := map[string]string{"BUZZ_BACKOFF_MAX": "100ms", "BUZZ_SWEEP_INTERVAL": "200ms"}
	r1 := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: relayKey, Env: env})

	vSK, vPK := testenv.NewKey()
	oSK, oPK := testenv.NewKey()
	viewer := testenv.Dial(t, r1.URL)
	viewer.Auth(vSK)
	other := testenv.Dial(t, r1.URL)
	other.Auth(oSK)
	ch := snapOpenDM(t, viewer, vSK, oPK)
	viewer.MustPublish(snapEvent(t, vSK, 41012, "", nostr.Tag{"h", ch})) // hide
	testenv.WaitUntil(t, 20*time.Second, "hide published", func() bool { g, p := snapGens(t, pool, vPK); return g > 0 && p == g })
	if _, hs := snapHead(t, pool, vPK); !slices.Equal(hs, []string{ch}) {
		t.Fatalf("after hide: %v", hs)
	}

	// Publication breaks.
	snapExec(t, pool, `CREATE FUNCTION public.fail_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'test: snapshot storage down'; END $$;
		CREATE TRIGGER fail_snapshots BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.fail_snapshots();`)
	msg := snapEvent(t, oSK, 9, "hello again", nostr.Tag{"h", ch})
	other.MustPublish(msg) // accepted: resurfaces the DM for the viewer
	target, published := snapGens(t, pool, vPK)
	if target != published+1 {
		t.Fatalf("resurfacing: target %d published %d", target, published)
	}
	testenv.WaitUntil(t, 20*time.Second, "publication failing", func() bool {
		return testenv.MustInt(t, pool, `SELECT coalesce(max(attempts), 0) FROM buzz.visibility_outbox WHERE viewer = $1`, vPK) >= 1
	})
	r1.Stop()

	// A new process; the viewer subscribes live on it before publication works again.
	r2 := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: relayKey, Env: env})
	live := testenv.Dial(t, r2.URL)
	live.Auth(vSK)
	sub := live.Subscribe(nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": []string{vPK}}})
	if evs := sub.Events(); len(evs) != 1 || !slices.Equal(snapHidden(evs[0]), []string{ch}) {
		t.Fatalf("initial query: %d snapshots", len(evs))
	}
	if _, p := snapGens(t, pool, vPK); p != published {
		t.Fatalf("published moved while failing")
	}
	snapExec(t, pool, `DROP TRIGGER fail_snapshots ON buzz.events`)

	got := sub.WaitN(2, 20*time.Second)[1] // the live snapshot after the initial one
	if ok, _ := got.CheckSignature(); !ok || got.PubKey != relayPK || len(snapHidden(got)) != 0 ||
		got.Tags.GetFirst([]string{"d", vPK}) == nil || got.Tags.GetFirst([]string{"p", vPK}) == nil {
		t.Fatalf("live snapshot %v", got)
	}
	// The live snapshot can arrive before its commit is visible to this test's session (logical
	// decoding reads the commit record before the committing backend becomes visible; see
	// relay/recent.go): wait for it, then check the generations.
	testenv.WaitUntil(t, 10*time.Second, "the live snapshot's commit visible", func() bool {
		_, p := snapGens(t, pool, vPK)
		return p >= target
	})
	if g, p := snapGens(t, pool, vPK); p != g || g != target {
		t.Fatalf("generations: target %d published %d, want %d", g, p, target)
	}
	head, _ := snapHead(t, pool, vPK)
	if head.ID != got.ID {
		t.Fatalf("head %s is not what the subscription received (%s)", head.ID, got.ID)
	}
	// The message was sent once, before the failure: the recovery came from its outbox row alone.
	// (A check that it is stored once could not fail: the id is the primary key.)
}

// 2 (cross-process). Publisher A (a `buzzpg serve` process) reads generation g = {X} and stops at
// publish.before_fence; the set changes to {} (g+1); publisher B (this test process, another OS
// process) publishes g+1 with a created_at BELOW A's (as after a clock step), so only the
// generation fence can stop A; A resumes and comes back 'stale'; the head stays {} at g+1.
func TestSnapshotServeStalePublisherAcrossProcesses(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	relayKey, relayPK := testenv.NewKey()
	snapExec(t, pool, `UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, relayPK)
	testenv.SnapshotAudit(t, pool)

	viewer, x := snapSQLDM(t, pool)
	// An earlier head, 30 s behind the clock (B will publish just above it).
	snapExec(t, pool, `SELECT buzz.bump_visibility($1)`, viewer)
	g0, _ := snapGens(t, pool, viewer)
	early := testenv.MustScalar[int64](t, pool, `SELECT buzz.now_unix()`) - 30
	// B is this test process: it signs and publishes through visibility.PublishSigned.
	signed := func(hidden []string, created int64) *nostr.Event {
		t.Helper()
		ev := visibility.BuildSnapshot(viewer, hidden, created)
		if err := ev.Sign(relayKey); err != nil {
			t.Fatal(err)
		}
		return ev
	}
	if out, err := visibility.PublishSigned(ctx, pool, viewer, g0, signed(nil, early)); err != nil || out != visibility.OutcomePublished {
		t.Fatalf("initial head: %q %v", out, err)
	}

	hookDir := t.TempDir()
	a := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: relayKey,
		HookDir: hookDir, Hooks: []string{visibility.HookBeforeFence}})
	snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, x) // g = {X}
	g, _ := snapGens(t, pool, viewer)
	hooks.Wait(t, hookDir, visibility.HookBeforeFence, 30*time.Second) // A holds g = {X}

	snapExec(t, pool, `SELECT buzz.unhide_dm($1, $2::uuid)`, viewer, x) // g+1 = {}
	src, err := visibility.ReadSource(ctx, pool, viewer)
	if err != nil || src.Generation != g+1 || len(src.Hidden) != 0 {
		t.Fatalf("source %+v %v", src, err)
	}
	if out, err := visibility.PublishSigned(ctx, pool, viewer, src.Generation, signed(src.Hidden, early+1)); err != nil || out != visibility.OutcomePublished {
		t.Fatalf("B: %q %v", out, err)
	}
	headB, _ := snapHead(t, pool, viewer)

	hooks.Release(t, hookDir, visibility.HookBeforeFence)
	testenv.WaitUntil(t, 20*time.Second, "A's outcome in its log", func() bool {
		return snapLogHas(a, `"msg":"snapshot stale"`, viewer) || snapLogHas(a, `"msg":"snapshot published"`, viewer)
	})
	if snapLogHas(a, `"msg":"snapshot published"`, viewer) {
		t.Fatal("A published after resuming: the generation fence did not hold")
	}
	head, hs := snapHead(t, pool, viewer)
	if head.ID != headB.ID || len(hs) != 0 {
		t.Fatalf("head %s %v, want B's %s with nothing hidden", head.ID, hs, headB.ID)
	}
	if tg, p := snapGens(t, pool, viewer); tg != g+1 || p != g+1 {
		t.Fatalf("generations target %d published %d, want %d", tg, p, g+1)
	}
	if gens := snapAssertAudit(t, pool, viewer); !slices.Equal(gens, []int64{g0, g + 1}) {
		t.Fatalf("publications %v, want [%d %d]", gens, g0, g+1)
	}
}
