// Package chaos is buzzpg's soak: three `buzzpg serve` processes on a private second PostgreSQL
// cluster, each reaching it through a TCP proxy the soak controls, simulated users over real
// WebSockets, and a seeded schedule of faults (see faults_test.go): kill -9 and restart of a relay,
// SIGSTOP of a relay past its leases, the network between a relay and PostgreSQL cut (also on a
// COMMIT's reply), immediate PostgreSQL restarts, and a replication slot invalidated by
// max_slot_wal_keep_size. At quiescence a checker verifies the promises (see TestChaosSoak).
//
//	BUZZ_CHAOS_DURATION    length of the fault phase (default 60s; `make chaos` uses 5m)
//	BUZZ_CHAOS_FAULT_EVERY mean time between faults (default: the phase / 12, at most 10s)
//	BUZZ_CHAOS_SEED        seed of the simulation and the faults (default: time; always logged)
//	BUZZ_CHAOS_USERS       simulated users (default 12)
//	BUZZ_CHAOS_KEEP        keep the run directory (client logs, relay logs) even when the soak passes
package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Bounds the checker states (and enforces).
const (
	quiescenceBound = 30 * time.Second // lag back to zero after the last fault and the last not_before
	deliveryBound   = 15 * time.Second // then: due signals reach connections that were open throughout
)

func TestChaosSoak(t *testing.T) {
	dur := 60 * time.Second
	if v := os.Getenv("BUZZ_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("BUZZ_CHAOS_DURATION=%q: %v", v, err)
		}
		dur = d
	}
	// Mean time between faults: by default a dozen in the fault phase, at most 10 s apart.
	every := min(10*time.Second, dur/12)
	if v := os.Getenv("BUZZ_CHAOS_FAULT_EVERY"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("BUZZ_CHAOS_FAULT_EVERY=%q: %v", v, err)
		}
		every = d
	}
	seed := time.Now().UnixNano()
	if v := os.Getenv("BUZZ_CHAOS_SEED"); v != "" {
		seed, _ = strconv.ParseInt(v, 10, 64)
	}
	nUsers := 12
	if v := os.Getenv("BUZZ_CHAOS_USERS"); v != "" {
		nUsers, _ = strconv.Atoi(v)
	}
	runDir := filepath.Join(testenv.RepoRoot(), "tests", "testdata", fmt.Sprintf("chaos-%d", time.Now().Unix()))
	if err := os.MkdirAll(runDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("BUZZ_CHAOS_KEEP") != "" {
			t.Logf("chaos: run directory kept: %s (clients.jsonl, relay*.log, events.log)", runDir)
			return
		}
		_ = os.RemoveAll(runDir)
	})
	evlog, err := os.Create(filepath.Join(runDir, "events.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer evlog.Close()
	start := time.Now()
	var logMu sync.Mutex
	logf := func(format string, args ...any) {
		line := fmt.Sprintf("[%7.2fs] ", time.Since(start).Seconds()) + fmt.Sprintf(format, args...)
		logMu.Lock()
		fmt.Fprintln(evlog, line)
		logMu.Unlock()
		t.Log(line)
	}
	logf("chaos: seed %d (BUZZ_CHAOS_SEED=%d reproduces the schedule), fault phase %s, a fault every %s on average, %d users, run dir %s",
		seed, seed, dur, every, nUsers, runDir)

	// PostgreSQL: a second private cluster, migrated, with the soak's own logical slot (test_decoding)
	// created before any relay starts: it records every due signal that is ever committed.
	cl := testenv.PrivateCluster(t, "chaos")
	cl.KeepIfFailed = os.Getenv("BUZZ_CHAOS_KEEP") != ""
	dbURL := cl.MigratedURL(t)
	ctx := context.Background()
	admin := connect(t, dbURL)
	if _, err := admin.Exec(ctx, `SELECT pg_create_logical_replication_slot('chaos_observer', 'test_decoding')`); err != nil {
		t.Fatalf("observer slot: %v", err)
	}
	admin.Close(ctx)

	relaySK := nostr.GeneratePrivateKey()
	relayPK, _ := nostr.GetPublicKey(relaySK)
	env := []string{
		"BUZZ_SWEEP_INTERVAL=1s", "BUZZ_LEASE=3s", "BUZZ_BACKOFF_MAX=2s", "BUZZ_SLOT_STALE_AFTER=60s",
		"BUZZ_REMINDER_LEASE=3s", "BUZZ_SHUTDOWN_GRACE=5s", "BUZZ_AUTO_MIGRATE=true",
	}
	logf("relay env: %s", strings.Join(env, " "))
	fl := newFleet(t, 3, testenv.Binary(t), dbURL, relaySK, runDir, env, logf)
	for i := 0; i < 3; i++ {
		if err := fl.start(i); err != nil {
			t.Fatal(err)
		}
	}

	rec, err := newRecorder(filepath.Join(runDir, "clients.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer rec.out.Close()
	users := make([]bench.User, nUsers)
	for i := range users {
		users[i] = bench.NewUser()
	}
	w := &world{rec: rec, fleet: fl, relaySK: relaySK, relayPK: relayPK, users: users,
		stopActs: make(chan struct{}), stopAll: make(chan struct{}), logf: logf}
	for i, u := range users {
		w.wg.Add(1)
		go w.runUser(seed+int64(i)+1, u)
	}
	outsider := bench.NewUser() // authenticated, member of nothing
	w.wg.Add(3)
	go w.runPassive(seed+1001, bench.User{}, "anonymous")
	go w.runPassive(seed+1002, bench.User{}, "anonymous")
	go w.runPassive(seed+1003, outsider, "outsider")
	stopped := false
	stopClients := func() {
		if !stopped {
			stopped = true
			close(w.stopAll)
			w.wg.Wait()
		}
	}
	defer stopClients()

	// Faults: the seeded schedule (see injector.run); readiness probed and memory sampled throughout.
	obs := newObserver()
	in := newInjector(cl, fl, dbURL, seed, 3*time.Second, obs, logf, t.Errorf)
	in.dueSoon = func() []string { return rec.dueSoon(time.Now(), 4*time.Second) }
	rd := watchReadiness(fl)
	warmAt := start.Add(max(10*time.Second, min(dur/10, time.Minute)))
	stopMem := make(chan struct{})
	mem := sampleWarm(fl, warmAt, stopMem)
	defer close(stopMem)
	go watchPauses(in, stopMem)
	in.run(start, dur, every)
	lastFault := time.Now()
	logf("fault phase over; all relays up; users stop acting")
	close(w.stopActs)
	time.Sleep(500 * time.Millisecond) // let in-flight publishes finish (their OKs are only logged)

	// Quiescence: polled, with a deadline, never assumed.
	rec.mu.Lock()
	var maxNB int64
	for _, s := range rec.sent {
		if s.Ev.Kind == 30300 {
			if nb, _ := strconv.ParseInt(firstTag(s.Ev, "not_before"), 10, 64); nb > maxNB {
				maxNB = nb
			}
		}
	}
	rec.mu.Unlock()
	from := lastFault
	if t := time.Unix(maxNB+1, 0); t.After(from) {
		from = t
	}
	deadline := from.Add(quiescenceBound)
	conn := connect(t, dbURL)
	defer conn.Close(ctx)
	var lagZeroAt time.Time
	var lastLag string
	for {
		pending, detail, err := lagNow(ctx, conn)
		if err == nil && pending == 0 && time.Now().After(time.Unix(maxNB+1, 0)) {
			lagZeroAt = time.Now()
			break
		}
		if err != nil {
			detail = err.Error()
		}
		lastLag = detail
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	v := newViolations()
	if lagZeroAt.IsZero() {
		v.add("lag returns to zero", "not within %s after the last fault (%s) and the last not_before (%d): %s",
			quiescenceBound, fmtTime(lastFault), maxNB, lastLag)
	} else {
		v.pass("lag returns to zero", "visibility_lag and reminder_status at zero %.1fs after the last fault (bound: %s after the later of the last fault and the last not_before)",
			lagZeroAt.Sub(lastFault).Seconds(), quiescenceBound)
	}

	// Due signals owed to connections open throughout: wait (bounded) until they arrived. A relay
	// whose slot was invalidated owes nothing committed in its slot gap (see slotGap).
	st, err := loadState(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	if err := obs.drain(ctx, conn, false); err != nil {
		t.Fatal(err)
	}
	commits := map[string][]pglogrepl.LSN{}
	for _, e := range obs.emissions() {
		commits[e.id] = append(commits[e.id], e.commit)
	}
	in.mu.Lock()
	gaps := append([]slotGap(nil), in.gaps...)
	in.mu.Unlock()
	inGap := func(url, id string) bool {
		for _, g := range gaps {
			for _, c := range commits[id] {
				if g.covers(url, c) {
					return true
				}
			}
		}
		return false
	}
	obligations, exempt := 0, 0
	owed := func() []string {
		rec.mu.Lock()
		defer rec.mu.Unlock()
		got := map[string]bool{}
		for _, r := range rec.recv {
			if r.Sub == "due" {
				got[fmt.Sprint(r.Conn, r.Ev.ID)] = true
			}
		}
		var missing []string
		obligations, exempt = 0, 0
		for _, r := range st.reminders {
			if r.state != "confirmed" || r.confirmedAt == nil {
				continue
			}
			for _, c := range rec.conns {
				e, ok := c.EOSE["due"]
				if c.User != r.pubkey || !ok || !e.Before(*r.confirmedAt) || !c.Closed.IsZero() {
					continue
				}
				if inGap(c.URL, r.id) {
					exempt++
					continue
				}
				obligations++
				if !got[fmt.Sprint(c.ID, r.id)] {
					missing = append(missing, fmt.Sprintf("reminder %s (author %s, confirmed %s, stamp %d): connection %d on %s open since %s (due sub ready %s) never received it",
						short(r.id), short(r.pubkey), fmtTime(*r.confirmedAt), deref(r.stamp), c.ID, c.URL, fmtTime(c.Opened), fmtTime(e)))
				}
			}
		}
		return missing
	}
	var missingDue []string
	dl := time.Now().Add(deliveryBound)
	for {
		missingDue = owed()
		if len(missingDue) == 0 || time.Now().After(dl) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	rd.halt()
	mem.sampleEnd(fl)
	stopClients()
	fl.stopAll()

	// ---- the checks ----
	st, err = loadState(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	if err := obs.drain(ctx, conn, false); err != nil {
		t.Fatal(err)
	}
	emissions := obs.emissions()
	rec.mu.Lock()
	defer rec.mu.Unlock()

	// 1. Every event that got OK true is stored (a superseded reminder version: a newer one is).
	okTrue, unknown := 0, 0
	kinds := map[int][3]int{} // kind -> ok true, ok false, no answer
	for _, s := range rec.sent {
		k := kinds[s.Ev.Kind]
		switch {
		case s.OK == nil:
			unknown++
			k[2]++
		case s.OK.OK:
			okTrue++
			k[0]++
		default:
			k[1]++
		}
		kinds[s.Ev.Kind] = k
		if s.OK == nil || !s.OK.OK {
			continue
		}
		if st.events[s.Ev.ID] {
			continue
		}
		if s.Ev.Kind == 30300 {
			head, ok := st.addrHead[s.Ev.PubKey+"/"+firstTag(s.Ev, "d")]
			if ok && (head[0].(int64) > int64(s.Ev.CreatedAt) || (head[0].(int64) == int64(s.Ev.CreatedAt) && head[1].(string) < s.Ev.ID)) {
				if _, armed := st.reminders[s.Ev.ID]; !armed {
					v.add("OK true is stored", "reminder %s got OK true at %s but has no buzz.reminders row", s.Ev.ID, fmtTime(s.OK.At))
				}
				continue
			}
		}
		v.add("OK true is stored", "event %s kind %d by %s sent on conn %d at %s, OK true %q at %s, is not in buzz.events",
			s.Ev.ID, s.Ev.Kind, short(s.Ev.PubKey), s.Conn, fmtTime(s.At), s.OK.Msg, fmtTime(s.OK.At))
	}
	v.pass("OK true is stored", "%d events got OK true, all stored (%d sends never answered: outcome unknown, not checked)", okTrue, unknown)

	// 2. Every viewer's published snapshot is the canonical hidden set, at the target generation.
	viewers := 0
	for viewer, gen := range st.viewers {
		viewers++
		want := sortedCopy(st.hidden[viewer])
		snaps := st.snapshots[viewer]
		if gen[0] != gen[1] {
			v.add("snapshot = hidden set", "viewer %s: target_generation %d != published_generation %d", viewer, gen[0], gen[1])
		}
		if len(snaps) == 0 {
			if len(want) > 0 {
				v.add("snapshot = hidden set", "viewer %s: hidden %v but no 30622 is stored", viewer, want)
			}
			continue
		}
		if len(snaps) > 1 {
			v.add("snapshot = hidden set", "viewer %s: %d kind 30622 heads stored", viewer, len(snaps))
		}
		sn := snaps[0]
		var got []string
		for _, tg := range sn.tags {
			if len(tg) >= 2 && tg[0] == "h" {
				got = append(got, tg[1])
			}
		}
		got = sortedCopy(got)
		if strings.Join(got, ",") != strings.Join(want, ",") || sn.pubkey != relayPK {
			v.add("snapshot = hidden set", "viewer %s: snapshot %s (created_at %d, generation published %d / target %d, signer %s) lists %v, canonical hidden set is %v",
				viewer, sn.id, sn.created, gen[1], gen[0], short(sn.pubkey), got, want)
		}
	}
	v.pass("snapshot = hidden set", "%d viewers: every head 30622 equals buzz.members hidden set, published_generation = target_generation", viewers)

	// 3. Due signals: emitted exactly once per confirmed version (the soak's own slot saw every
	// committed emission), none for the rest; every due version delivered; no connection got one twice.
	emitted := map[string][]int64{}
	for _, e := range emissions {
		emitted[e.id] = append(emitted[e.id], e.stamp)
	}
	now := time.Now().Unix()
	confirmed, recovered := 0, 0
	for _, r := range st.reminders {
		n := len(emitted[r.id])
		switch r.state {
		case "confirmed":
			confirmed++
			if n != 1 {
				v.add("due signal exactly once", "reminder %s (author %s, not_before %d, confirmed %v, stamp %d, claims %d, recoveries %d) emitted %d times (stamps %v)",
					r.id, short(r.pubkey), r.notBefore, r.confirmedAt, deref(r.stamp), r.claims, r.recoveries, n, emitted[r.id])
			} else if r.stamp == nil || emitted[r.id][0] != *r.stamp {
				v.add("due signal exactly once", "reminder %s confirmed under stamp %d but emitted with stamp %v", r.id, deref(r.stamp), emitted[r.id])
			}
		case "armed", "claimed":
			if r.notBefore <= now {
				v.add("due signal exactly once", "reminder %s (author %s, not_before %d) is still %s at %s: due but never delivered (claims %d, recoveries %d)",
					r.id, short(r.pubkey), r.notBefore, r.state, time.Now().Format("15:04:05"), r.claims, r.recoveries)
			}
			if n != 0 {
				v.add("due signal exactly once", "reminder %s is %s but was emitted %d times", r.id, r.state, n)
			}
		case "cancelled":
			if n != 0 {
				v.add("due signal exactly once", "reminder %s is cancelled but was emitted %d times (stamps %v)", r.id, n, emitted[r.id])
			}
		}
		if r.recoveries > 0 {
			recovered++
		}
	}
	for id, stamps := range emitted {
		if _, ok := st.reminders[id]; !ok {
			v.add("due signal exactly once", "due signal for %s (stamps %v) has no buzz.reminders row", id, stamps)
		}
	}
	perConn := map[string]int{}
	dueRecv := 0
	for _, r := range rec.recv {
		if r.Sub != "due" {
			continue
		}
		dueRecv++
		k := fmt.Sprint(r.Conn, " ", r.Ev.ID)
		perConn[k]++
		if perConn[k] == 2 {
			v.add("no connection receives a due signal twice", "connection %d (%s) received due signal %s twice (second at %s)",
				r.Conn, short(rec.conns[r.Conn].User), r.Ev.ID, fmtTime(r.At))
		}
		rr, ok := st.reminders[r.Ev.ID]
		if !ok || rr.state != "confirmed" && len(emitted[r.Ev.ID]) == 0 {
			v.add("due signal exactly once", "connection %d received a due signal for %s which was never emitted", r.Conn, r.Ev.ID)
		} else if r.At.Before(time.Unix(rr.notBefore, 0)) {
			v.add("due signal exactly once", "connection %d received due signal %s at %s, before its not_before %d", r.Conn, r.Ev.ID, fmtTime(r.At), rr.notBefore)
		}
	}
	for _, m := range missingDue {
		v.add("due signal reaches connections open throughout", "%s", m)
	}
	v.pass("due signal exactly once", "%d reminder versions confirmed, each emitted exactly once (%d emissions seen by the observer slot, %d versions recovered after a lease); %d due receipts by clients",
		confirmed, len(emissions), recovered, dueRecv)
	v.pass("no connection receives a due signal twice", "%d (connection, reminder) receipts, none twice", len(perConn))
	v.pass("due signal reaches connections open throughout", "%d (reminder, connection) pairs where the due subscription was ready before the confirmation and stayed open: all received it (%d more pairs fell in a relay's slot gap: not owed live, the reminder itself stays queryable)", obligations, exempt)

	// 4. Read gates, applied to every client's log with the pubkeys it had asked to AUTH as.
	for _, r := range rec.recv {
		c := rec.conns[r.Conn]
		authed := map[string]bool{}
		for pk, at := range c.AuthSent {
			if !at.After(r.At) {
				authed[pk] = true
			}
		}
		ok, why := readable(r.Ev, authed, st.members, relayPK)
		if !ok {
			v.add("read gates", "connection %d (%s %s) received %s (kind %d by %s) on sub %q at %s: %s",
				r.Conn, c.Role, short(c.User), r.Ev.ID, r.Ev.Kind, short(r.Ev.PubKey), r.Sub, fmtTime(r.At), why)
		}
	}
	v.pass("read gates", "%d receipts checked against the read gates (docs/protocol.md)", len(rec.recv))

	// 5. Every relay is ready again within readyBound after the faults touching it ended.
	badReady, probes, unreadyN := rd.check(in)
	for _, m := range badReady {
		v.add("ready again after each fault", "%s", m)
	}
	v.pass("ready again after each fault", "%d /readyz probes, %d unready, all within a fault or %s after it", probes, unreadyN, readyBound)

	// 6. Memory: no relay ends far above what it used after warm-up.
	badMem, memSummary := mem.check()
	for _, m := range badMem {
		v.add("memory within bound", "%s", m)
	}
	v.pass("memory within bound", "RSS after warm-up -> at the end: %s(bound %.1f× + %.0f MB)", memSummary, memFactor, memSlackMB)

	// 7. Every slot invalidation ended in a new slot (waitNewSlot), and the others were not lost.
	var lostOthers int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE wal_status = 'lost' AND slot_name = 'chaos_observer'`).Scan(&lostOthers); err != nil || lostOthers > 0 {
		v.add("slot invalidation accounted", "the observer slot was invalidated (emissions may be missing) or unreadable: %v", err)
	}
	var gapNotes []string
	for _, g := range gaps {
		gapNotes = append(gapNotes, fmt.Sprintf("relay %d new slot %.1fs after waking, gap %s..%s", g.relay, g.newSlotIn.Seconds(), g.from, g.to))
	}
	v.pass("slot invalidation accounted", "%d invalidations, each followed by a new slot: %s", len(gaps), strings.Join(gapNotes, "; "))

	// ---- report ----
	var b strings.Builder
	fmt.Fprintf(&b, "\n==== chaos soak: seed %d, fault phase %s, %d users, %d client connections ====\n", seed, dur, nUsers, len(rec.conns))
	ks := make([]int, 0, len(kinds))
	for k := range kinds {
		ks = append(ks, k)
	}
	sort.Ints(ks)
	for _, k := range ks {
		fmt.Fprintf(&b, "  sent kind %-5d  OK true %5d  OK false %4d  unanswered %3d\n", k, kinds[k][0], kinds[k][1], kinds[k][2])
	}
	okFalse := map[string]int{}
	for _, s := range rec.sent {
		if s.OK != nil && !s.OK.OK {
			p := s.OK.Msg
			if i := strings.IndexByte(p, ':'); i > 0 {
				p = p[:i]
			}
			okFalse[p]++
		}
	}
	fmt.Fprintf(&b, "  OK false by prefix: %v; receipts %d; reminders %d\n", okFalse, len(rec.recv), len(st.reminders))
	var stored int64
	_ = conn.QueryRow(ctx, `SELECT count(*) FROM buzz.events`).Scan(&stored)
	fmt.Fprintf(&b, "  events stored %d; reminder versions emitted exactly once %d; lag zero %.1fs after the last fault\n",
		stored, confirmed, lagZeroAt.Sub(lastFault).Seconds())
	fmt.Fprintf(&b, "  memory per relay (RSS after warm-up -> end): %s\n", memSummary)
	in.mu.Lock()
	fmt.Fprintf(&b, "  faults by kind: %s\n", in.summaryLocked())
	for _, sk := range in.skipped {
		fmt.Fprintf(&b, "  NOTE fault skipped: %s\n", sk)
	}
	fmt.Fprintf(&b, "  faults (%d notes, all in events.log)\n", len(in.list))
	in.mu.Unlock()
	for _, u := range fl.unexpectedExits() {
		fmt.Fprintf(&b, "  NOTE unexpected process exit (restarted by the supervisor): %s\n", u)
	}
	checks := []string{"OK true is stored", "snapshot = hidden set", "due signal exactly once",
		"no connection receives a due signal twice", "due signal reaches connections open throughout", "read gates", "lag returns to zero",
		"ready again after each fault", "memory within bound", "slot invalidation accounted"}
	for _, c := range checks {
		if ev := v.m[c]; len(ev) > 0 {
			fmt.Fprintf(&b, "  FAIL %-48s %d violation(s):\n", c, len(ev))
			for i, e := range ev {
				if i == 25 {
					fmt.Fprintf(&b, "      ... %d more\n", len(ev)-25)
					break
				}
				fmt.Fprintf(&b, "      %s\n", e)
			}
		} else {
			fmt.Fprintf(&b, "  PASS %-48s %s\n", c, v.ok[c])
		}
	}
	logf("%s", b.String())
	if len(v.order) > 0 {
		t.Errorf("chaos soak: %d check(s) failed: %s (seed %d)", len(v.order), strings.Join(v.order, "; "), seed)
	}
}

func lagNow(ctx context.Context, conn *pgx.Conn) (int64, string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var pending, claimed, expired int64
	var oldest *float64
	if err := conn.QueryRow(ctx, `SELECT pending_viewers, oldest_pending_seconds, claimed, expired_leases FROM buzz.visibility_lag()`).
		Scan(&pending, &oldest, &claimed, &expired); err != nil {
		return -1, "", err
	}
	var armed, due, rclaimed, stuck int64
	if err := conn.QueryRow(ctx, `SELECT armed, due, claimed, stuck FROM buzz.reminder_status()`).Scan(&armed, &due, &rclaimed, &stuck); err != nil {
		return -1, "", err
	}
	detail := fmt.Sprintf("visibility_lag: pending_viewers=%d oldest=%vs claimed=%d expired_leases=%d; reminder_status: armed=%d due=%d claimed=%d stuck=%d",
		pending, deref(oldest), claimed, expired, armed, due, rclaimed, stuck)
	return pending + due + rclaimed, detail, nil
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := ctxTimeout(30 * time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	return c
}

func firstTag(ev *nostr.Event, name string) string {
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == name {
			return t[1]
		}
	}
	return ""
}

func contains(s []int, x int) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}

func deref[T any](p *T) any {
	if p == nil {
		return "null"
	}
	return *p
}
