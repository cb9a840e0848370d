package reminders

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A reminder claim that broke off after rows arrived rolls back the claims it received, at once
// instead of after the lease (an hour here), and each reminder is still emitted exactly once.
func TestSchedulerClaimBrokenOffRollsBack(t *testing.T) {
	testenv.ForEachClaimBreak(t, testSchedulerClaimBrokenOff)
}

func testSchedulerClaimBrokenOff(t *testing.T, mode testenv.ClaimBreak) {
	e := newEnv(t)
	nb := time.Now().Unix() - 10
	first := e.store(nb) // claims come back by not_before: this one arrives before the cut
	var second *nostr.Event
	if mode == testenv.BreakCommitted {
		second = e.store(nb + 1)
	}
	var blk *testenv.ClaimBlock
	if mode != testenv.BreakCommitted {
		blk = testenv.BlockClaimCommits(t, e.pool, "buzz.reminders", "NEW.state = 'claimed' AND OLD.state <> 'claimed'")
	}
	cut := testenv.NewRowCut("claim_due_reminders(")
	if mode == testenv.BreakCommitsLater {
		cut.DropCancels()
	}
	undone := testenv.PauseAt(t, HookClaimUndone, nil)
	logs := &testenv.LogBuf{}
	s := NewScheduler(Config{InstanceID: "cut", DatabaseURL: e.url, Lease: time.Hour,
		Logger: testenv.Logger(t, slog.LevelInfo, logs)}, cut.Pool(t, e.url))
	startScheduler(t, s)
	openGate := undone.OpenAtCleanup(t)

	// Past the broken claim: either its undo is done (held at the gate), or the batch failed
	// without one.
	handled := func() bool { return undone.Reached() || strings.Contains(logs.String(), "reminder batch failed") }
	testenv.WaitCut(t, cut)
	blk.ReleaseLateCommit(mode, "the scheduler", handled)
	testenv.WaitUntil(t, 10*time.Second, "the broken claim handled", handled)
	if strings.Contains(logs.String(), "not settled") {
		t.Fatalf("the undo gave up waiting for the claim to end:\n%s", logs.String())
	}

	st, rollbacks, claims := claimState(t, e, first.ID)
	if st != "armed" {
		t.Fatalf("the reminder whose claim arrived is %s after the claim broke off, want armed: it waits out the hour-long lease", st)
	}
	switch {
	case mode == testenv.BreakAborts && (rollbacks != 0 || claims != 0):
		t.Fatalf("a claim that never committed: %d rollbacks, %d claims recorded, want none (the undo must change nothing)", rollbacks, claims)
	case mode != testenv.BreakAborts && rollbacks != 1:
		t.Fatalf("%d rollbacks, want 1", rollbacks)
	}
	if second != nil {
		// Its row was claimed too, but its stamp never reached us: lease recovery's, as before.
		if st, _, _ := claimState(t, e, second.ID); st != "claimed" {
			t.Fatalf("the reminder whose claim did not arrive is %s, want claimed (nobody knows its stamp)", st)
		}
	}

	if blk != nil {
		blk.Release() // later claims go through
		blk.Drop()
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

func claimState(t *testing.T, e *env, id string) (state string, rollbacks, claims int) {
	t.Helper()
	if err := e.pool.QueryRow(context.Background(), `SELECT state, rollbacks, claims FROM buzz.reminders WHERE id = $1`, id).
		Scan(&state, &rollbacks, &claims); err != nil {
		t.Fatal(err)
	}
	return
}
