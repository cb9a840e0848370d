package listener

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// How a claim statement breaks off after its first row reached us (the connection is cut there).
type claimBreak int

const (
	// The claim committed before its rows were sent: PostgreSQL sends a small result after the
	// commit. The common case.
	breakCommitted claimBreak = iota
	// The rows were sent before the commit (a large result, or a NOTICE, flushes them), and the
	// claim commits after the break: the server has not noticed its client is gone, and the
	// cancel request pgx sends for a broken connection is lost with the network.
	breakCommitsLater
	// As before, but pgx's cancel request arrives and the claim fails in its commit: the undo
	// must change nothing.
	breakAborts
)

var claimBreaks = []struct {
	name string
	mode claimBreak
}{{"committed", breakCommitted}, {"commits_after_the_break", breakCommitsLater}, {"never_commits", breakAborts}}

// A reminder claim that broke off after rows arrived rolls back the claims it received, at once
// instead of after the lease (an hour here), and each reminder is still emitted exactly once.
func TestSchedulerClaimBrokenOffRollsBack(t *testing.T) {
	for _, bc := range claimBreaks {
		t.Run(bc.name, func(t *testing.T) { testSchedulerClaimBrokenOff(t, bc.mode) })
	}
}

func testSchedulerClaimBrokenOff(t *testing.T, mode claimBreak) {
	e := newRemEnv(t)
	nb := time.Now().Unix() - 10
	first := e.store(nb) // claims come back by not_before: this one arrives before the cut
	var second *nostr.Event
	if mode == breakCommitted {
		second = e.store(nb + 1)
	}
	var blk *claimBlock
	if mode != breakCommitted {
		blk = blockClaimCommits(t, e.pool, "buzz.reminders", "NEW.state = 'claimed' AND OLD.state <> 'claimed'")
	}
	cut := testenv.NewRowCut("claim_due_reminders(")
	if mode == breakCommitsLater {
		cut.DropCancels()
	}
	undone := pauseAt(t, HookReminderClaimUndone, "")
	logs := &pubLogBuf{}
	s := NewScheduler(SchedulerConfig{InstanceID: "cut", DatabaseURL: e.url, Lease: time.Hour,
		Logger: pubLogger(t, logs)}, cut.Pool(t, e.url))
	startScheduler(t, s)
	openGate := gateOpener(t, undone)

	// Past the broken claim: either its undo is done (held at the gate), or the batch failed
	// without one.
	handled := func() bool { return reachedGate(undone) || strings.Contains(logs.String(), "reminder batch failed") }
	waitCut(t, cut)
	if mode == breakCommitsLater {
		pid := blk.waitBlocked()
		testenv.WaitUntil(t, 10*time.Second, "the scheduler waiting for the claim to end, or past it", func() bool {
			return handled() || waitingForRowLock(t, e.pool)
		})
		blk.release()
		blk.waitDone(pid)
	}
	testenv.WaitUntil(t, 10*time.Second, "the broken claim handled", handled)
	if strings.Contains(logs.String(), "not settled") {
		t.Fatalf("the undo gave up waiting for the claim to end:\n%s", logs.String())
	}

	st, rollbacks, claims := remClaimState(t, e, first.ID)
	if st != "armed" {
		t.Fatalf("the reminder whose claim arrived is %s after the claim broke off, want armed: it waits out the hour-long lease", st)
	}
	switch {
	case mode == breakAborts && (rollbacks != 0 || claims != 0):
		t.Fatalf("a claim that never committed: %d rollbacks, %d claims recorded, want none (the undo must change nothing)", rollbacks, claims)
	case mode != breakAborts && rollbacks != 1:
		t.Fatalf("%d rollbacks, want 1", rollbacks)
	}
	if second != nil {
		// Its row was claimed too, but its stamp never reached us: lease recovery's, as before.
		if st, _, _ := remClaimState(t, e, second.ID); st != "claimed" {
			t.Fatalf("the reminder whose claim did not arrive is %s, want claimed (nobody knows its stamp)", st)
		}
	}

	if blk != nil {
		blk.release() // later claims go through
		blk.drop()
	}
	openGate()
	e.waitState(first.ID, "confirmed", 10*time.Second)
	due := e.dueStamps()
	if len(due[first.ID]) != 1 {
		t.Fatalf("due signals of the rolled-back reminder: %v, want exactly one", due[first.ID])
	}
	if second != nil && len(due[second.ID]) != 0 {
		t.Fatalf("due signals of the reminder still leased: %v, want none yet", due[second.ID])
	}
}

// A snapshot claim that broke off after rows arrived releases every row of its claim id, the
// ones that never arrived too, at once instead of after the lease; each viewer is then
// published once.
func TestSnapshotClaimBrokenOffReleases(t *testing.T) {
	for _, bc := range claimBreaks {
		t.Run(bc.name, func(t *testing.T) { testSnapshotClaimBrokenOff(t, bc.mode) })
	}
}

func testSnapshotClaimBrokenOff(t *testing.T, mode claimBreak) {
	e := newPubEnv(t)
	n := 3
	if mode != breakCommitted {
		n = 2
	}
	var viewers []string
	for range n {
		v, _ := e.hiddenViewer()
		viewers = append(viewers, v)
	}
	var blk *claimBlock
	if mode != breakCommitted {
		blk = blockClaimCommits(t, e.pool, "buzz.visibility_outbox",
			"NEW.claim_id IS NOT NULL AND NEW.claim_id IS DISTINCT FROM OLD.claim_id")
	}
	cut := testenv.NewRowCut("claim_visibility_work(")
	if mode == breakCommitsLater {
		cut.DropCancels()
	}
	undone := pauseAt(t, HookSnapshotClaimUndone, "A")
	cfg := e.publisher("A", func(c *PublisherConfig) { c.Lease = time.Hour; c.Workers = 1 }).cfg
	p := NewPublisher(cfg, cut.Pool(t, e.url))
	e.start(p) // its first claim takes every row
	openGate := gateOpener(t, undone)

	handled := func() bool {
		return reachedGate(undone) || strings.Contains(e.logs.String(), "visibility claim failed")
	}
	waitCut(t, cut)
	if mode == breakCommitsLater {
		pid := blk.waitBlocked()
		testenv.WaitUntil(t, 10*time.Second, "the publisher waiting for the claim to end, or past it", func() bool {
			return handled() || waitingForRowLock(t, e.pool)
		})
		blk.release()
		blk.waitDone(pid)
	}
	testenv.WaitUntil(t, 10*time.Second, "the broken claim handled", handled)
	if strings.Contains(e.logs.String(), "not settled") {
		t.Fatalf("the undo gave up waiting for the claim to end:\n%s", e.logs.String())
	}

	if held := mustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = ANY($1) AND claim_id IS NOT NULL`, viewers); held > 0 {
		t.Fatalf("%d of %d outbox rows still claimed after the claim broke off: they wait out the hour-long lease", held, n)
	}
	if left := mustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = ANY($1) AND attempts = 0 AND available_at <= now()`, viewers); left != n {
		t.Fatalf("%d of %d outbox rows available without backoff", left, n)
	}
	want := n // committed: all of them, the rows that never arrived too
	if mode == breakAborts {
		want = 0 // nothing was held under the claim id
	}
	if !strings.Contains(e.logs.String(), fmt.Sprintf("released=%d ", want)) {
		t.Fatalf("the release of the broken claim did not report %d rows:\n%s", want, e.logs.String())
	}

	if blk != nil {
		blk.release() // later claims go through
		blk.drop()
	}
	openGate()
	if mode == breakAborts {
		// The rows are as they were, and nothing announces them again: the periodic sweep (an
		// hour here) would.
		p.kickDrain()
	}
	e.waitConverged(viewers, 10*time.Second)
	if pubs := e.assertAuditMonotonic(); pubs != n {
		t.Fatalf("%d publications for %d viewers, want one each", pubs, n)
	}
}

func startScheduler(t *testing.T, s *Scheduler) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer ccancel()
		_ = s.Close(cctx)
	})
}

// gateOpener opens g once, and at the latest when the test ends (before what was registered
// earlier stops the component held there).
func gateOpener(t *testing.T, g *gate) func() {
	var once sync.Once
	open := func() { once.Do(g.open) }
	t.Cleanup(open)
	return open
}

func reachedGate(g *gate) bool {
	select {
	case <-g.reached:
		return true
	default:
		return false
	}
}

func waitCut(t *testing.T, c *testenv.RowCut) {
	t.Helper()
	select {
	case <-c.Cut():
	case <-time.After(10 * time.Second):
		t.Fatal("no claim reached the cut")
	}
}

// waitingForRowLock reports whether a backend other than the blocked claim waits for a row lock
// (the undo waiting for the claim to end).
func waitingForRowLock(t *testing.T, q testenv.Querier) bool {
	return mustInt(t, q, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()
		  AND wait_event_type = 'Lock' AND wait_event <> 'advisory' AND query LIKE '%FOR SHARE%'`) > 0
}

func remClaimState(t *testing.T, e *remEnv, id string) (state string, rollbacks, claims int) {
	t.Helper()
	if err := e.pool.QueryRow(context.Background(), `SELECT state, rollbacks, claims FROM buzz.reminders WHERE id = $1`, id).
		Scan(&state, &rollbacks, &claims); err != nil {
		t.Fatal(err)
	}
	return
}
