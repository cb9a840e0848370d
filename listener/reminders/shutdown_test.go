package reminders

import (
	"log/slog"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A scheduler stopped mid-claim rolls its claim back, so another one fires the reminder at once
// instead of after the lease.
func TestSchedulerStopDuringClaimRollsBack(t *testing.T) {
	e := newEnv(t)
	blk := testenv.BlockClaims(t, e.pool, "buzz.reminders", "NEW.state = 'claimed' AND OLD.state <> 'claimed'")
	ev := e.store(time.Now().Unix() - 1)

	s := NewScheduler(Config{InstanceID: "stopping", DatabaseURL: e.url, Lease: time.Hour,
		Logger: testenv.Logger(t, slog.LevelInfo, nil)}, e.pool)
	cancel, stopped := testenv.RunStoppable(t, s.Run) // its first batch claims the due reminder and blocks
	blk.StopWhileBlocked(cancel, stopped)

	if st, rb, _ := e.state(ev.ID); st != "armed" || rb != 1 {
		t.Fatalf("after stopping mid-claim: %s with %d rollbacks, want armed/1 (not held for the lease)", st, rb)
	}
	e.start("other", Config{})
	e.waitState(ev.ID, "confirmed", 10*time.Second)
	if due := e.dueStamps(); len(due[ev.ID]) != 1 {
		t.Fatalf("due messages %v", due)
	}
}
