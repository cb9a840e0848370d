package visibility

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A snapshot claim that broke off after rows arrived releases every row of its claim id, the
// ones that never arrived too, at once instead of after the lease; each viewer is then
// published once.
func TestSnapshotClaimBrokenOffReleases(t *testing.T) {
	testenv.ForEachClaimBreak(t, testSnapshotClaimBrokenOff)
}

func testSnapshotClaimBrokenOff(t *testing.T, mode testenv.ClaimBreak) {
	e := newEnv(t)
	n := 3
	if mode != testenv.BreakCommitted {
		n = 2
	}
	var viewers []string
	for range n {
		v, _ := e.hiddenViewer()
		viewers = append(viewers, v)
	}
	var blk *testenv.ClaimBlock
	if mode != testenv.BreakCommitted {
		blk = testenv.BlockClaimCommits(t, e.pool, "buzz.visibility_outbox",
			"NEW.claim_id IS NOT NULL AND NEW.claim_id IS DISTINCT FROM OLD.claim_id")
	}
	cut := testenv.NewRowCut("claim_visibility_work(")
	if mode == testenv.BreakCommitsLater {
		cut.DropCancels()
	}
	undone := pauseAt(t, HookClaimUndone, "A")
	cfg := e.publisher("A", func(c *Config) { c.Lease = time.Hour; c.Workers = 1 }).cfg
	p := NewPublisher(cfg, cut.Pool(t, e.url))
	e.start(p) // its first claim takes every row
	openGate := undone.OpenAtCleanup(t)

	handled := func() bool {
		return undone.Reached() || strings.Contains(e.logs.String(), "visibility claim failed")
	}
	testenv.WaitCut(t, cut)
	blk.ReleaseLateCommit(mode, "the publisher", handled)
	testenv.WaitUntil(t, 10*time.Second, "the broken claim handled", handled)
	if strings.Contains(e.logs.String(), "not settled") {
		t.Fatalf("the undo gave up waiting for the claim to end:\n%s", e.logs.String())
	}

	if held := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = ANY($1) AND claim_id IS NOT NULL`, viewers); held > 0 {
		t.Fatalf("%d of %d outbox rows still claimed after the claim broke off: they wait out the hour-long lease", held, n)
	}
	if left := testenv.MustInt(t, e.pool, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = ANY($1) AND attempts = 0 AND available_at <= now()`, viewers); left != n {
		t.Fatalf("%d of %d outbox rows available without backoff", left, n)
	}
	want := n // committed: all of them, the rows that never arrived too
	if mode == testenv.BreakAborts {
		want = 0 // nothing was held under the claim id
	}
	if !strings.Contains(e.logs.String(), fmt.Sprintf("released=%d ", want)) {
		t.Fatalf("the release of the broken claim did not report %d rows:\n%s", want, e.logs.String())
	}

	if blk != nil {
		blk.Release() // later claims go through
		blk.Drop()
	}
	openGate()
	if mode == testenv.BreakAborts {
		// The rows are as they were, and nothing announces them again: the periodic sweep (an
		// hour here) would.
		p.kickDrain()
	}
	e.waitConverged(viewers, 10*time.Second)
	if pubs := e.assertAuditMonotonic(); pubs != n {
		t.Fatalf("%d publications for %d viewers, want one each", pubs, n)
	}
}
