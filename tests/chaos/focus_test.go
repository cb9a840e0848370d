package chaos

// Focused tests, one per fault kind of the soak beyond kill -9 and PostgreSQL restarts: each drives
// its fault once, deterministically, against the guard it exercises.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/fanout"
)

// focusCluster is a private cluster for one focused test (slot invalidation changes server
// settings; the others share its shape), migrated, with a test_decoding observer slot.
func focusCluster(t *testing.T) (url string, db func() *pgx.Conn) {
	t.Helper()
	cl := testenv.PrivateCluster(t, "chaos-focus")
	url = cl.MigratedURL(t)
	c := connect(t, url)
	t.Cleanup(func() { c.Close(context.Background()) })
	if _, err := c.Exec(context.Background(), `SELECT pg_create_logical_replication_slot('chaos_observer', 'test_decoding')`); err != nil {
		t.Fatal(err)
	}
	return url, func() *pgx.Conn { return c }
}

// acceptSQL stores ev through buzz.accept_event.
func acceptSQL(t *testing.T, c *pgx.Conn, ev *nostr.Event) {
	t.Helper()
	raw, _ := json.Marshal(ev)
	var ok bool
	var msg string
	if err := c.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg); err != nil || !ok {
		t.Fatalf("accept %s: ok=%v %q %v", ev.ID, ok, msg, err)
	}
}

func dueReminder(t *testing.T) *nostr.Event {
	t.Helper()
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	ev := &nostr.Event{Kind: 30300, CreatedAt: nostr.Timestamp(now), Content: "focus",
		Tags: nostr.Tags{{"d", "focus"}, {"not_before", fmt.Sprint(now - 1)}}}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

func reached(dir, hook string) bool {
	_, err := os.Stat(filepath.Join(dir, hook+".reached"))
	return err == nil
}

// waitReady polls /readyz until 200 or the bound passes.
func waitReady(t *testing.T, p *bench.Proc, bound time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(bound)
	var err error
	for time.Now().Before(deadline) {
		if err = bench.Ready(p.HTTPURL); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s: not ready within %s: %v", what, bound, err)
}

// Freeze: a relay stopped (SIGSTOP) between claiming a reminder and confirming it, past its lease;
// the other relay re-takes the claim (new stamp) and holds it; the frozen one wakes and confirms
// under its old stamp: the stamp refuses it (the row stays claimed under the new stamp, nothing
// is emitted), the other's confirm emits once, and the woken process is ready again on its own.
func TestFocusFreezeStaleClaimerFenced(t *testing.T) {
	url, db := focusCluster(t)
	ctx := context.Background()
	breakStampFence(t, db())
	const hook = "reminder.after_claim"
	dirs := [2]string{t.TempDir(), t.TempDir()}
	key, _ := testenv.NewKey()
	var opts []testenv.RelayOpts
	for i := range dirs {
		opts = append(opts, testenv.RelayOpts{DatabaseURL: url, RelayKey: key, HookDir: dirs[i], Hooks: []string{hook},
			Env: map[string]string{"BUZZ_REMINDER_LEASE": "2s"}})
	}
	relays := testenv.StartRelays(t, opts...)
	ev := dueReminder(t)
	acceptSQL(t, db(), ev)

	x := -1
	testenv.WaitUntil(t, 30*time.Second, "a relay claims the reminder", func() bool {
		for i, d := range dirs {
			if reached(d, hook) {
				x = i
				return true
			}
		}
		return false
	})
	y := 1 - x
	if err := syscall.Kill(relays[x].Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(relays[x].Pid(), syscall.SIGCONT) })
	var stale int64
	_ = db().QueryRow(ctx, `SELECT stamp FROM buzz.reminders WHERE id = $1`, ev.ID).Scan(&stale)
	testenv.WaitUntil(t, 30*time.Second, "the other relay re-takes the expired claim", func() bool { return reached(dirs[y], hook) })

	hooks.Release(t, dirs[x], hook)
	if err := syscall.Kill(relays[x].Pid(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 30*time.Second, "the woken relay's confirm ran", func() bool {
		return strings.Contains(relays[x].Log(), `"msg":"reminder batch"`)
	})
	var state string
	var stamp int64
	if err := db().QueryRow(ctx, `SELECT state, stamp FROM buzz.reminders WHERE id = $1`, ev.ID).Scan(&state, &stamp); err != nil {
		t.Fatal(err)
	}
	if state != "claimed" || stamp == stale {
		t.Errorf("after the stale claimer (stamp %d) confirmed: reminder %s under stamp %d, want still claimed under the new stamp", stale, state, stamp)
	}
	hooks.Release(t, dirs[y], hook)
	testenv.WaitUntil(t, 30*time.Second, "the new claimer confirms", func() bool {
		_ = db().QueryRow(ctx, `SELECT state FROM buzz.reminders WHERE id = $1`, ev.ID).Scan(&state)
		return state == "confirmed"
	})
	obs := newObserver()
	if err := obs.drain(ctx, db(), false); err != nil {
		t.Fatal(err)
	}
	var stamps []int64
	for _, e := range obs.emissions() {
		if e.id == ev.ID {
			stamps = append(stamps, e.stamp)
		}
	}
	if len(stamps) != 1 || stamps[0] == stale {
		t.Errorf("due signal emissions (stamps) %v, want exactly one, not under the stale stamp %d", stamps, stale)
	}
	waitReady(t, relays[x].Proc, readyBound, "the woken relay")
	select {
	case <-relays[x].Done():
		t.Fatalf("the woken relay exited: %v", relays[x].ExitErr())
	default:
	}
}

// breakStampFence, with BUZZ_CHAOS_BREAK=stamp (a demonstration, never in a normal run), drops
// the stamp from confirm_reminder_claims' fence in this test's database.
func breakStampFence(t *testing.T, c *pgx.Conn) {
	if os.Getenv("BUZZ_CHAOS_BREAK") != "stamp" {
		return
	}
	var def string
	if err := c.QueryRow(context.Background(), `SELECT pg_get_functiondef('buzz.confirm_reminder_claims(text[],bigint[])'::regprocedure)`).Scan(&def); err != nil {
		t.Fatal(err)
	}
	broken := strings.NewReplacer(" AND l.stamp = v.stamp", "", "x.stamp = u.stamp AND ", "").Replace(def)
	if broken == def {
		t.Fatal("BUZZ_CHAOS_BREAK=stamp: the fence was not found in confirm_reminder_claims")
	}
	if _, err := c.Exec(context.Background(), broken); err != nil {
		t.Fatal(err)
	}
	t.Log("BUZZ_CHAOS_BREAK=stamp: confirm_reminder_claims no longer checks the stamp")
}

// Network cut: every connection between a relay and PostgreSQL (pools and replication) goes dead
// for a few seconds; the relay turns unready, and once the path is back it is ready again (its
// pools and its replication stream reconnected) within readyBound, without a restart.
func TestFocusNetworkCutReadyAgain(t *testing.T) {
	url, _ := focusCluster(t)
	px := testenv.StartTCPProxy(t, testenv.TargetOf(t, url))
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: px.ProxyURL(t, url), Env: map[string]string{"BUZZ_BACKOFF_MAX": "2s"}})
	px.Cut()
	testenv.WaitUntil(t, 30*time.Second, "the relay turns unready while cut", func() bool { return bench.Ready(r.HTTPURL) != nil })
	time.Sleep(3 * time.Second)
	px.Restore()
	waitReady(t, r.Proc, readyBound, "after the network came back")
	select {
	case <-r.Done():
		t.Fatalf("the relay exited: %v", r.ExitErr())
	default:
	}
}

// Slot invalidation: a relay held (SIGSTOP) while the WAL moves past max_slot_wal_keep_size loses
// its slot (wal_status 'lost'); woken, it makes a new slot on its own and is ready again.
func TestFocusSlotInvalidatedNewSlot(t *testing.T) {
	url, db := focusCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, Env: map[string]string{"BUZZ_BACKOFF_MAX": "2s"}})
	slot := fanout.SlotName(r.InstanceID)
	if err := syscall.Kill(r.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(r.Pid(), syscall.SIGCONT) })
	obs := newObserver()
	if err := moveWAL(ctx, db(), nil, func() error { return obs.drain(ctx, db(), true) }); err != nil {
		t.Fatal(err)
	}
	lost, err := invalidate(ctx, db(), slot)
	if err != nil || !lost {
		t.Fatalf("slot %s not invalidated: %v", slot, err)
	}
	if err := syscall.Kill(r.Pid(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if _, err := waitNewSlot(ctx, db(), slot); err != nil {
		t.Fatalf("no new slot %s after the relay woke: %v", slot, err)
	}
	waitReady(t, r.Proc, readyBound, "after its slot was invalidated")
}

// Network cut mid-commit: the path dies as the reply of a reminder's confirm passes (the server
// committed it and emitted the due signal; the relay never hears back). Once the path is back,
// the relay resolves the unknown outcome by re-reading the row under its stamp: it counts the
// reminder confirmed (not failed, not lost), nothing is emitted twice, and it is ready again.
func TestFocusCutMidCommitOutcomeResolved(t *testing.T) {
	url, db := focusCluster(t)
	ctx := context.Background()
	px := testenv.StartTCPProxy(t, testenv.TargetOf(t, url))
	const hook = "reminder.after_claim"
	dir := t.TempDir()
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: px.ProxyURL(t, url), HookDir: dir, Hooks: []string{hook},
		Env: map[string]string{"BUZZ_BACKOFF_MAX": "2s", "BUZZ_REMINDER_LEASE": "30s", "BUZZ_METRICS_LISTEN": metricsAddr}})
	ev := dueReminder(t)
	acceptSQL(t, db(), ev)
	testenv.WaitUntil(t, 30*time.Second, "the relay claims the reminder", func() bool { return reached(dir, hook) })

	fired := px.CutOnReply([]byte(ev.ID)) // the next reply naming it: the confirm's
	hooks.Release(t, dir, hook)
	select {
	case <-fired:
	case <-time.After(20 * time.Second):
		t.Fatal("no reply of the confirm passed the proxy")
	}
	var state string
	if err := db().QueryRow(ctx, `SELECT state FROM buzz.reminders WHERE id = $1`, ev.ID).Scan(&state); err != nil || state != "confirmed" {
		t.Fatalf("when its reply was cut the confirm had not committed: state %q, %v", state, err)
	}
	time.Sleep(time.Second)
	px.Restore()
	outcome := func(o string) float64 {
		return metricValue(t, metricsAddr, `buzz_reminder_claims_total{outcome="`+o+`"}`)
	}
	testenv.WaitUntil(t, 30*time.Second, "the relay counts the reminder confirmed", func() bool { return outcome("confirmed") == 1 })
	if !strings.Contains(r.Log(), "reminder confirm outcome unknown") {
		t.Error("the relay never met the unknown outcome: the cut missed its confirm")
	}
	if f, l := outcome("failed"), outcome("lost"); f != 0 || l != 0 {
		t.Errorf("after the unknown outcome: %v failed, %v lost, want 0 and 0 (the confirm committed)", f, l)
	}
	obs := newObserver()
	if err := obs.drain(ctx, db(), false); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range obs.emissions() {
		if e.id == ev.ID {
			n++
		}
	}
	if n != 1 {
		t.Errorf("due signal emitted %d times, want 1", n)
	}
	waitReady(t, r.Proc, readyBound, "after the cut")
}

// metricValue reads one sample (name with its labels, as exposed) from the metrics listener.
func metricValue(t *testing.T, addr, sample string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, sample+" "); ok {
			v, _ := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v
		}
	}
	return 0
}
