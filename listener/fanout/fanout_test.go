package fanout

import (
	"context"
	"errors"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestSlotName(t *testing.T) {
	if got := SlotName("abc_1"); got != "buzz_abc_1" {
		t.Errorf("SlotName(abc_1) = %q: an id that needs no change keeps its plain name", got)
	}
	valid := regexp.MustCompile(`^buzz_[a-z0-9_]+$`)
	long := strings.Repeat("relay-deployment-with-a-long-name-", 3)
	// Pairs that sanitising or the 63-byte cut would merge must still get two slots.
	for _, pair := range [][2]string{
		{"Relay-1", "relay_1"},
		{"Host-1.a:B", "host_1_a_b"},
		{long + "7f9c2", long + "x8k2q"}, // Kubernetes pod names: the unique part is last
		{strings.Repeat("x", 80), strings.Repeat("x", 81)},
	} {
		a, b := SlotName(pair[0]), SlotName(pair[1])
		if a == b {
			t.Errorf("SlotName(%q) = SlotName(%q) = %q", pair[0], pair[1], a)
		}
		for _, n := range []string{a, b} {
			if len(n) > 63 || !valid.MatchString(n) {
				t.Errorf("slot name %q: over 63 bytes or outside [a-z0-9_]", n)
			}
		}
	}
	if SlotName("Relay-1") != SlotName("Relay-1") {
		t.Error("SlotName is not stable")
	}
}

func TestWalLevelMessage(t *testing.T) {
	h := newHarness(t)
	if err := CheckWalLevel(context.Background(), h.pool); err != nil {
		t.Fatalf("test cluster runs wal_level=logical, got %v", err)
	}
	msg := (&WalLevelError{Level: "replica"}).Error()
	for _, want := range []string{"wal_level is replica", "wal_level=logical", "ALTER SYSTEM SET wal_level = logical", "restart PostgreSQL"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
}

// Stored events (via accept_event), ephemeral events (accept_event's logical message) and due
// signals arrive once each, decoded with their scope; a rolled-back transaction delivers nothing.
func TestFanoutDeliversEachOnce(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	h.start(Config{}, sink, nil)

	var keys []string
	pub := signedEvent(1, "hello", nostr.Tags{{"t", "x"}, {"e", strings.Repeat("a", 64), "wss://r", "root"}})
	h.accept(ctx, pub)
	keys = append(keys, pub.ID)

	gift := signedEvent(1059, "sealed", nostr.Tags{{"p", strings.Repeat("b", 64)}})
	h.accept(ctx, gift)
	keys = append(keys, gift.ID)

	eph := signedEvent(20001, "typing", nil)
	h.accept(ctx, eph)
	keys = append(keys, eph.ID)

	rem := signedEvent(30300, "enc", nostr.Tags{{"d", "r1"}})
	h.emit(ctx, map[string]any{"t": "due", "ev": rem, "stamp": 42, "scope": "a"})
	keys = append(keys, rem.ID+"/42")

	// Several events in one transaction.
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		ev := signedEvent(1, "batch", nil)
		b, _ := ev.MarshalJSON()
		if _, err := tx.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(b)); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, ev.ID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// Rolled back: neither the row nor the message may come out.
	rb := signedEvent(1, "rolled back", nil)
	rbEph := signedEvent(20002, "rolled back", nil)
	tx, _ = h.pool.Begin(ctx)
	for _, ev := range []*nostr.Event{rb, rbEph} {
		b, _ := ev.MarshalJSON()
		if _, err := tx.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(b)); err != nil {
			t.Fatal(err)
		}
	}
	_ = tx.Rollback(ctx)

	// A barrier committed after the rollback: once it arrived, the rolled-back work would have too.
	barrier := signedEvent(1, "barrier", nil)
	h.accept(ctx, barrier)
	keys = append(keys, barrier.ID)

	sink.waitAll(t, keys, 20*time.Second)
	sink.assertExactlyOnce(t, keys)

	d, _ := sink.get(pub.ID)
	if d.Event.Content != "hello" || d.Event.Kind != 1 || d.Event.PubKey != pub.PubKey || d.Event.Sig != pub.Sig ||
		d.Event.CreatedAt != pub.CreatedAt || len(d.Event.Tags) != 3 || d.Event.Tags[1][3] != "root" || d.Scope.Kind != evt.ScopePublic || d.due {
		t.Errorf("stored event decoded wrong: %+v %+v", d.Event, d.Scope)
	}
	if ok, _ := d.Event.CheckSignature(); !ok || d.Event.GetID() != pub.ID {
		t.Errorf("decoded event no longer verifies")
	}
	if d, _ := sink.get(gift.ID); d.Scope.Kind != evt.ScopeP || d.Scope.P != strings.Repeat("b", 64) {
		t.Errorf("gift wrap scope = %+v, want p-scoped to its recipient", d.Scope)
	}
	if d, _ := sink.get(eph.ID); d.Event.Kind != 20001 || d.Scope.Kind != evt.ScopePublic || d.due {
		t.Errorf("ephemeral decoded wrong: %+v %+v", d.Event, d.Scope)
	}
	if d, _ := sink.get(rem.ID + "/42"); !d.due || d.stamp != 42 || d.Event.Kind != 30300 {
		t.Errorf("due signal decoded wrong: %+v", d)
	}
}

// Kill the walsender again and again while events flow: every event is delivered exactly once
// (the named slot backfills, our position and ids de-duplicate).
func TestFanoutWalsenderKilledWhileFlowing(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	inst := instanceID("kill")
	// Acknowledge rarely, so each reconnect finds the slot's confirmed position behind what we
	// handled and the server really resends: the test then fails if our de-duplication breaks.
	f, _ := h.start(Config{InstanceID: inst, StatusInterval: time.Hour}, sink, nil)

	// The writer runs until the last kill is done, so every kill lands while events flow. Every
	// tenth event is ephemeral: those emitted while the stream is down are still in WAL, so the
	// slot backfills them too.
	stop := make(chan struct{})
	done := make(chan []string, 1)
	errc := make(chan error, 1)
	go func() {
		var written []string
		defer func() { done <- written }()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			k := 1
			if i%10 == 0 {
				k = 20000
			}
			ev := signedEvent(k, "flow", nil)
			b, _ := ev.MarshalJSON()
			if _, err := h.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(b)); err != nil {
				errc <- err
				return
			}
			written = append(written, ev.ID)
		}
	}()

	for kills := 0; kills < 4; {
		// Barrier: the stream is attached and has delivered something since the last kill.
		before := f.deliveredN.Load()
		testenv.WaitUntil(t, 20*time.Second, "delivery progress", func() bool { return f.Ready() && f.deliveredN.Load() > before+100 })
		pid := h.walsenderPID(ctx, inst)
		if pid == 0 {
			continue
		}
		var ok bool
		if err := h.pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("terminate walsender %d: %v %v", pid, ok, err)
		}
		kills++
	}
	close(stop)
	keys := <-done
	select {
	case err := <-errc:
		t.Fatal(err)
	default:
	}
	t.Logf("%d events written during 4 walsender kills", len(keys))
	sink.waitAll(t, keys, 30*time.Second)
	// A last barrier so late duplicates would have arrived before we count.
	last := signedEvent(1, "last", nil)
	h.accept(ctx, last)
	sink.waitAll(t, []string{last.ID}, 20*time.Second)
	sink.assertExactlyOnce(t, append(keys, last.ID))
	if s := f.sessions.Load(); s < 2 {
		t.Errorf("only %d replication sessions: the walsender kills did not bite", s)
	}
	t.Logf("sessions=%d skipped_txn=%d skipped_dup=%d delivered=%d", f.sessions.Load(), f.skippedTxn.Load(), f.skippedDup.Load(), f.deliveredN.Load())
}

// PostgreSQL 15 may resend changes already acknowledged after a crash. Simulated: the next
// session asks the server to start from 0, and the slot was never acknowledged past its creation,
// so the server resends everything. Our own position must drop all of it.
func TestFanoutResendDedupedByLSN(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	inst := instanceID("resend")
	forget := make(chan bool, 1)
	f, _ := h.start(Config{InstanceID: inst, StatusInterval: time.Hour}, sink, func(f *Fanout) {
		f.startHook = func(last pglogrepl.LSN) pglogrepl.LSN {
			select {
			case forgetIDs := <-forget:
				if forgetIDs {
					// Also lose the LSN memory so only the id window stands between the resend
					// and a duplicate delivery.
					f.lastEnd = 0
				}
				return 0
			default:
				return last
			}
		}
	})
	var keys []string
	for i := 0; i < 50; i++ {
		ev := signedEvent(1, "before", nil)
		h.accept(ctx, ev)
		keys = append(keys, ev.ID)
	}
	eph := signedEvent(20000, "eph", nil)
	h.accept(ctx, eph)
	keys = append(keys, eph.ID)
	sink.waitAll(t, keys, 20*time.Second)

	for round, forgetIDs := range []bool{false, true} {
		skippedTxn, skippedDup := f.skippedTxn.Load(), f.skippedDup.Load()
		sessions := f.sessions.Load()
		forget <- forgetIDs
		pid := h.walsenderPID(ctx, inst)
		if _, err := h.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
			t.Fatal(err)
		}
		testenv.WaitUntil(t, 20*time.Second, "reattached", func() bool { return f.sessions.Load() > sessions && f.Ready() })
		after := signedEvent(1, "after", nil)
		h.accept(ctx, after)
		keys = append(keys, after.ID)
		sink.waitAll(t, keys, 20*time.Second)
		sink.assertExactlyOnce(t, keys)
		if !forgetIDs && f.skippedTxn.Load()-skippedTxn < 51 {
			t.Errorf("round %d: server resent only %d transactions; the simulation did not resend", round, f.skippedTxn.Load()-skippedTxn)
		}
		if forgetIDs && f.skippedDup.Load()-skippedDup < 51 {
			t.Errorf("round %d: id window skipped only %d deliveries", round, f.skippedDup.Load()-skippedDup)
		}
	}
}

// A dead instance's slot (inactive, heartbeat older than StaleAfter) is dropped by a live one; an
// active slot is never dropped even when its heartbeat looks stale; slots of other databases are
// never touched.
func TestFanoutReapsStaleSlots(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	// "Crash" A: stop its Run without Close, so slot and row stay behind and heartbeats stop.
	a, stopA := h.start(Config{InstanceID: instanceID("dead"), Heartbeat: time.Hour, StaleAfter: time.Hour}, newRecSink(), nil)
	stopA()
	testenv.WaitUntil(t, 10*time.Second, "A detached", func() bool { return !a.Ready() })

	// C is alive but we make its heartbeat look old: its slot is active, so it must survive.
	c, _ := h.start(Config{InstanceID: instanceID("live"), Heartbeat: time.Hour, StaleAfter: time.Hour}, newRecSink(), nil)
	if _, err := h.pool.Exec(ctx, `UPDATE buzz.instances SET heartbeat_at = now() - interval '1 hour' WHERE slot_name = $1`, c.slot); err != nil {
		t.Fatal(err)
	}

	// A buzz_ slot in another database: not ours to reap.
	other := newHarness(t)
	foreign := SlotName(instanceID("foreign"))
	if _, err := other.pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, foreign); err != nil {
		t.Fatal(err)
	}

	// The clock starts once the reaper runs: creating its own slot first waits for transactions
	// open anywhere on the cluster (other test packages), which is not part of the bound.
	// The reaper reaps once its own beats have run gap-free for StaleAfter (a gap is 2 s here: two
	// heartbeats, so a beat may take 0.9 s); the bound allows one gap restarting that run.
	const hb, stale = time.Second, 3 * time.Second
	b, _ := h.start(Config{InstanceID: instanceID("reaper"), Heartbeat: hb, StaleAfter: stale}, newRecSink(), nil)
	t0 := time.Now()
	testenv.WaitUntil(t, 20*time.Second, "dead slot dropped", func() bool { return !h.slotExists(ctx, a.slot) })
	if el, bound := time.Since(t0), 2*stale+2*hb+2*time.Second; el > bound {
		t.Errorf("dead slot dropped after %s; bound is StaleAfter of beats, once restarted, + a heartbeat + 2 s = %s", el, bound)
	}
	testenv.WaitUntil(t, 5*time.Second, "dead instance row removed", func() bool {
		return testenv.MustInt(t, h.pool, `SELECT count(*) FROM buzz.instances WHERE slot_name = $1`, a.slot) == 0
	})
	if !h.slotExists(ctx, c.slot) || !h.slotExists(ctx, b.slot) || !h.slotExists(ctx, foreign) {
		t.Fatalf("a live, own or foreign slot was dropped")
	}
	// C keeps working.
	sinkC := c.sink.(*recSink)
	ev := signedEvent(1, "still here", nil)
	h.accept(ctx, ev)
	sinkC.waitAll(t, []string{ev.ID}, 10*time.Second)
}

// Close drops the process's own slot and instance row.
func TestFanoutCloseDropsSlot(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	f, _ := h.start(Config{}, newRecSink(), nil)
	if !h.slotExists(ctx, f.slot) {
		t.Fatal("no slot while running")
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := f.Close(cctx); err != nil {
		t.Fatal(err)
	}
	if h.slotExists(ctx, f.slot) {
		t.Error("slot survived Close")
	}
	if testenv.MustInt(t, h.pool, `SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, f.cfg.InstanceID) != 0 {
		t.Error("instance row survived Close")
	}
	if err := f.Run(ctx); err == nil {
		t.Error("Run after Close must fail")
	}
}

// Close removes the instance row even when the slot stays in use past its context (a walsender
// that has not noticed the closed connection yet; here another session holds it): the slot is
// then an orphan that a reaper drops as soon as it is inactive, not after StaleAfter.
func TestFanoutCloseRemovesInstanceRowWhenSlotStaysInUse(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	f, stop := h.start(Config{}, newRecSink(), nil)
	stop()
	testenv.WaitUntil(t, 10*time.Second, "own walsender gone", func() bool {
		return testenv.MustInt(t, h.pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active`, f.slot) == 0
	})
	// Another session takes the slot, as our own walsender would still hold it for a while.
	holder := &Fanout{cfg: Config{DatabaseURL: h.url, InstanceID: "holder"}}
	conn, err := holder.connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if err := pglogrepl.StartReplication(ctx, conn, f.slot, 0,
		pglogrepl.StartReplicationOptions{PluginArgs: pluginArgs}); err != nil {
		t.Fatal(err)
	}
	if testenv.MustInt(t, h.pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1 AND active`, f.slot) != 1 {
		t.Fatal("the holder does not hold the slot")
	}

	// Long enough for the DELETE on a loaded machine; the drop still runs out of it (the holder
	// keeps the slot throughout).
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if err := f.Close(cctx); err == nil || !strings.Contains(err.Error(), "still in use") {
		t.Fatalf("Close with a held slot: got %v, want the drop's still-in-use error", err)
	}
	if n := testenv.MustInt(t, h.pool, `SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, f.cfg.InstanceID); n != 0 {
		t.Fatalf("instance row survived Close: the slot now waits out StaleAfter instead of being an orphan")
	}
	// Once the holder lets go, any reaper drops the orphan, whatever its staleness threshold.
	_ = conn.Close(ctx)
	testenv.WaitUntil(t, 10*time.Second, "orphan slot reaped", func() bool {
		_, _ = h.pool.Exec(ctx, `SELECT * FROM buzz.reap_instances(interval '1 hour')`)
		return !h.slotExists(ctx, f.slot)
	})
}

// Slot creation waits for transactions older than the attempt; the timeout logs who blocks and
// start-up proceeds once the blocker is gone.
func TestFanoutSlotCreationBlockedLogsPID(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	blocker, err := h.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer blocker.Release()
	var pid int
	if err := blocker.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	tx, err := blocker.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT txid_current()`); err != nil { // holds an xid
		t.Fatal(err)
	}
	logs := &testenv.LogBuf{}
	cfg := Config{DatabaseURL: h.url, InstanceID: instanceID("blocked"), SlotCreateTimeout: 300 * time.Millisecond, Logger: testenv.Logger(t, slog.LevelDebug, logs)}
	f := New(cfg, h.pool, newRecSink())
	rctx, stop := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- f.Run(rctx) }()
	t.Cleanup(func() {
		stop()
		c, cc := context.WithTimeout(context.Background(), 10*time.Second)
		defer cc()
		_ = f.Close(c)
	})
	testenv.WaitUntil(t, 20*time.Second, "blocker logged", func() bool {
		s := logs.String()
		return strings.Contains(s, "blocked by an open transaction") && strings.Contains(s, "pid="+strconv.Itoa(pid))
	})
	if f.Ready() {
		t.Fatal("attached although slot creation was blocked")
	}
	_ = tx.Rollback(ctx)
	testenv.WaitUntil(t, 20*time.Second, "attached after blocker ended", f.Ready)
	select {
	case err := <-errc:
		t.Fatalf("Run returned: %v", err)
	default:
	}
}

// A role without REPLICATION cannot stream: Run fails at once with what to do, instead of
// retrying forever.
func TestFanoutNeedsReplicationRole(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	role := instanceID("norepl")
	for _, q := range []string{
		`CREATE ROLE ` + role + ` LOGIN NOREPLICATION`,
		`GRANT USAGE ON SCHEMA buzz TO ` + role,
		`GRANT ALL ON buzz.instances TO ` + role,
	} {
		if _, err := h.pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = h.pool.Exec(ctx, `DROP OWNED BY `+role)
		_, _ = h.pool.Exec(ctx, `DROP ROLE `+role)
	})
	roleURL := testenv.AsRole(t, h.url, role)
	pool := testenv.Pool(t, roleURL)
	f := New(Config{DatabaseURL: roleURL, InstanceID: instanceID("norepl"), Logger: testenv.Logger(t, slog.LevelDebug, nil)}, pool, newRecSink())
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	t0 := time.Now()
	err := f.Run(rctx)
	t.Logf("Run returned after %s: %v", time.Since(t0), err)
	if err == nil || !strings.Contains(err.Error(), "REPLICATION") {
		t.Fatalf("Run = %v, want an error naming the REPLICATION attribute", err)
	}
}

// A hand-off that does not finish (the sink waits, as the relay does while it retries a member
// lookup) shows as a growing Lag, the figure behind buzz_fanout_lag_seconds and the relay's
// de-dup window, not as the lag of the last transaction that got through.
func TestFanoutLagGrowsWhileAHandOffWaits(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	sink.onDeliver = func(d delivery) {
		if d.Event.Content != "stuck" {
			return
		}
		entered <- struct{}{}
		<-release
	}
	f, _ := h.start(Config{}, sink, nil)
	first := signedEvent(1, "flows", nil)
	h.accept(ctx, first)
	sink.waitAll(t, []string{first.ID}, 10*time.Second)
	stuck := signedEvent(1, "stuck", nil)
	h.accept(ctx, stuck)
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the stuck event never reached the sink")
	}
	testenv.WaitUntil(t, 10*time.Second, "lag to pass 500ms while the hand-off waits", func() bool { return f.Lag() > 500*time.Millisecond })
	close(release)
	sink.waitAll(t, []string{stuck.ID}, 10*time.Second)
	testenv.WaitUntil(t, 10*time.Second, "lag back under 500ms", func() bool {
		next := signedEvent(1, "after", nil)
		h.accept(ctx, next)
		sink.waitAll(t, []string{next.ID}, 10*time.Second)
		return f.Lag() < 500*time.Millisecond
	})
}

// The de-dup window catches a transaction resent after a break, not the same id in a later
// transaction: an event deleted and stored again (a replaced head published again, a raw DELETE)
// is a new delivery, and a subscriber that came after the deletion must get it.
func TestFanoutDeliversAnIdStoredAgain(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	h.start(Config{}, sink, nil)
	ev := signedEvent(1, "stored twice", nil)
	h.accept(ctx, ev)
	sink.waitAll(t, []string{ev.ID}, 10*time.Second)
	if _, err := h.pool.Exec(ctx, `DELETE FROM buzz.events WHERE id = $1`, ev.ID); err != nil {
		t.Fatal(err)
	}
	h.accept(ctx, ev)
	marker := signedEvent(1, "after", nil)
	h.accept(ctx, marker)
	sink.waitAll(t, []string{marker.ID}, 10*time.Second) // in commit order: the re-insert came first
	sink.mu.Lock()
	n := sink.byKey[ev.ID]
	sink.mu.Unlock()
	if n != 2 {
		t.Fatalf("the event stored twice was delivered %d times, want 2", n)
	}
}

// When a process may reap: after StaleAfter of beats without a long gap. One failed beat (a
// normal gap of two heartbeats) does not restart the count; an outage (a gap of gap or more) does.
func TestReapClock(t *testing.T) {
	const hb = time.Second
	t0 := time.Unix(1_700_000_000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	r := reapClock{gap: 2 * hb, staleAfter: 6 * hb}
	if r.mayReap(t0) {
		t.Fatal("reaps before any successful beat")
	}
	r.ok(at(0))
	r.ok(at(1 * hb))
	// The beat at 2 s failed; the next success is 2 heartbeats - 1 ms later: not an outage.
	r.ok(at(3*hb - time.Millisecond))
	r.ok(at(4 * hb))
	r.ok(at(5 * hb))
	if r.mayReap(at(5 * hb)) {
		t.Fatal("reaps before StaleAfter of beats")
	}
	r.ok(at(6 * hb))
	if !r.mayReap(at(6 * hb)) {
		t.Fatal("one failed beat stopped reaping")
	}
	// An outage: no success for 10 s. The count starts again at the first beat back.
	r.ok(at(16 * hb))
	if r.mayReap(at(16*hb)) || r.mayReap(at(21*hb)) {
		t.Fatal("reaps right after an outage")
	}
	for s := 17; s <= 22; s++ {
		r.ok(at(time.Duration(s) * hb))
	}
	if !r.mayReap(at(22 * hb)) {
		t.Fatal("does not reap StaleAfter after the outage")
	}
	// A beat that fails, right after a long run: no reap, whatever the run says (the database
	// may be coming back from an outage in which nobody could beat).
	if r.beat(errors.New("the database system is starting up"), at(22*hb+hb)) {
		t.Fatal("reaps right after its own beat failed")
	}
	if !r.beat(nil, at(24*hb-time.Millisecond)) {
		t.Fatal("a beat back within the gap does not reap")
	}
}

// A slot created anew starts from its own position, not from the one this process remembers of
// the old slot: after a failover or a restore, WAL positions begin below that one again, and
// every commit up to it would be skipped. Simulated with a remembered position far ahead of the
// server's WAL when the slot is created.
func TestFanoutNewSlotForgetsTheOldPosition(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	h.start(Config{}, sink, func(f *Fanout) {
		f.lastEnd = pglogrepl.LSN(1) << 62 // from a timeline this server never had
	})
	ev := signedEvent(1, "after the new slot", nil)
	h.accept(ctx, ev)
	sink.waitAll(t, []string{ev.ID}, 20*time.Second)
}

// A slot that vanished took with it whatever member edits were announced while it was gone, and
// a cached member set is only dropped when its announcement arrives: on the new slot, the sink is
// told to forget every set before the first event. The second session is held after its slot
// check while the test drops the slot, so the third one finds it missing.
func TestFanoutNewSlotForgetsEveryMemberSet(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	parked, release := make(chan struct{}), make(chan struct{})
	var sessions atomic.Int32
	f, _ := h.start(Config{}, sink, func(f *Fanout) {
		f.startHook = func(last pglogrepl.LSN) pglogrepl.LSN {
			if sessions.Add(1) == 2 {
				close(parked)
				<-release
			}
			return last
		}
	})
	before := signedEvent(1, "on the first slot", nil)
	h.accept(ctx, before)
	sink.waitAll(t, []string{before.ID}, 20*time.Second)

	if _, err := h.pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1`, f.slot); err != nil {
		t.Fatal(err)
	}
	select {
	case <-parked:
	case <-time.After(30 * time.Second):
		t.Fatal("the fan-out did not reconnect")
	}
	testenv.WaitUntil(t, 20*time.Second, "slot dropped", func() bool {
		_, err := h.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, f.slot)
		return err == nil
	})
	close(release)
	testenv.WaitUntil(t, 30*time.Second, "slot made again", func() bool { return f.slotsMade.Load() == 2 })
	after := signedEvent(1, "on the new slot", nil)
	h.accept(ctx, after)
	sink.waitAll(t, []string{after.ID}, 20*time.Second)

	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.resets) != 1 {
		t.Fatalf("told of a stream reset (forget every member set and snapshot) %d times, want once (on the new slot)", len(sink.resets))
	}
	if at := sink.resets[0]; at < 1 || at >= len(sink.all) || sink.all[at].Event.ID != after.ID {
		t.Fatalf("forget came after %d deliveries, want it between the event on the old slot and the one on the new", at)
	}
}

// Each delivery carries its transaction's id and commit position: the relay compares them with a
// REQ's snapshot to tell events its initial query saw from new ones.
func TestFanoutDeliveriesCarryTheirTransaction(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	h.start(Config{}, sink, nil)
	lsnAt := func() uint64 {
		var lsn int64
		if err := h.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`).Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		return uint64(lsn)
	}
	before := lsnAt()
	ev := signedEvent(1, "which transaction", nil)
	h.accept(ctx, ev)
	after := lsnAt()
	sink.waitAll(t, []string{ev.ID}, 20*time.Second)
	var xmin int64
	if err := h.pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM buzz.events WHERE id = $1`, ev.ID).Scan(&xmin); err != nil {
		t.Fatal(err)
	}
	d, _ := sink.get(ev.ID)
	if d.Xid == 0 || d.Xid != uint32(xmin) {
		t.Fatalf("delivery Xid %d, want the inserting transaction %d", d.Xid, xmin)
	}
	if d.CommitLSN <= before || d.CommitLSN >= after {
		t.Fatalf("delivery CommitLSN %d, want the commit's, between %d and %d", d.CommitLSN, before, after)
	}
}

// A second process started by mistake with the instance id of a running one finds its slot,
// cannot attach (55006), and when it stops leaves the owner's instance row and slot alone. Before,
// its Close deleted the row, and the owner's slot, now an orphan, was dropped by the next reaper
// the moment it was inactive (a walsender restart), a gap for the owner's subscribers.
func TestFanoutDuplicateInstanceLeavesTheOwnersSlot(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	owner, _ := h.start(Config{}, newRecSink(), nil)
	instance := owner.cfg.InstanceID

	dup := New(Config{DatabaseURL: h.url, InstanceID: instance, Logger: testenv.Logger(t, slog.LevelDebug, nil)}, h.pool, newRecSink())
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- dup.Run(runCtx) }()
	select {
	case <-dup.SlotReady(): // it found the owner's slot
	case <-time.After(30 * time.Second):
		t.Fatal("the duplicate never found the slot")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("duplicate Run: %v", err)
	}
	cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
	defer ccancel()
	if err := dup.Close(cctx); err != nil {
		t.Fatalf("duplicate Close: %v", err)
	}
	if n := testenv.MustInt(t, h.pool, `SELECT count(*) FROM buzz.instances WHERE instance_id = $1`, instance); n != 1 {
		t.Fatalf("the owner's instance row is gone after the duplicate stopped (%d rows)", n)
	}
	if !h.slotExists(ctx, owner.slot) {
		t.Fatal("the owner's slot is gone after the duplicate stopped")
	}
	if !owner.Ready() {
		t.Fatal("the owner is no longer attached")
	}
}

// Slot names are cluster-wide: an instance id whose slot a process of another database already
// made cannot stream here, and no retry changes that. Run fails at once, saying to change the id
// (before, it retried with a warning for good, and a start that raced the other one's creation
// took 42710 for its own slot and served without live delivery).
func TestFanoutSlotOfAnotherDatabaseIsFatal(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	instance := instanceID("elsewhere")
	other := testenv.Pool(t, testenv.EmptyDB(t))
	if _, err := other.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, SlotName(instance)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = other.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, SlotName(instance)) })
	f := New(Config{DatabaseURL: h.url, InstanceID: instance, Logger: testenv.Logger(t, slog.LevelDebug, nil)}, h.pool, newRecSink())
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err := f.Run(rctx)
	if err == nil || !strings.Contains(err.Error(), "belongs to database") {
		t.Fatalf("Run = %v, want a fatal error naming the other database", err)
	}
	// The race: creation found the name taken (42710) by the other database's slot.
	if _, err := createSlot(ctx, h.pool, SlotName(instance), 10*time.Second, testenv.Logger(t, slog.LevelDebug, nil)); err == nil || !strings.Contains(err.Error(), "belongs to database") {
		t.Fatalf("createSlot over another database's slot = %v, want the other database named", err)
	}
}

// Run returns soon after its context ends, even while the stream waits for a message that may not
// come for an hour: reads wait on the socket's deadline, and the context's end moves it to now.
func TestFanoutRunEndsWithItsContext(t *testing.T) {
	h := newHarness(t)
	f := New(Config{DatabaseURL: h.url, InstanceID: instanceID("lt"), StatusInterval: time.Hour,
		Logger: testenv.Logger(t, slog.LevelDebug, nil)}, h.pool, newRecSink())
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- f.Run(ctx) }()
	t.Cleanup(func() {
		cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer ccancel()
		_ = f.Close(cctx)
	})
	testenv.WaitUntil(t, 30*time.Second, "fan-out attached", f.Ready)
	cancel()
	select {
	case <-errc:
	case <-time.After(5 * time.Second):
		t.Fatal("Run still waits on the stream 5 s after its context ended")
	}
}
