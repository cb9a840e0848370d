package reminders

import (
	"context"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

// HookClaimUndone is the pause point after a broken-off claim was given back (or the attempt
// gave up): tests wait there.
const HookClaimUndone = "reminder.claim_undone"

// undoClaim rolls back the claims of a claim statement that broke off after got had arrived.
// Rows taken but not received stay to lease recovery: their stamps never reached us.
//
// docs/design.md has the scheduler re-read by stamp, never roll back, after a commit whose outcome is
// unknown: that is the CONFIRM, whose commit emits the due signal, so a rollback there could
// re-arm a signal that went out and have it emitted twice. A claim emits nothing, and no confirm
// of these rows can have run (we never started one; it needs our stamps, which nobody else has),
// so re-arming an unconfirmed claim under our stamp only makes the reminder claimable again; its
// next claim gets a new stamp and emits it once.
func (s *Scheduler) undoClaim(ctx context.Context, got []claim, cause error) {
	if len(got) == 0 || listener.SettledByError(cause) {
		return
	}
	ctx, cancel := listener.UndoContext(ctx)
	defer cancel()
	defer hooks.At(ctx, HookClaimUndone)
	s.log.Warn("reminder claim broke off after rows arrived; rolling back the claims received",
		"n", len(got), "err", cause)
	if err := listener.AwaitClaimEnd(ctx, s.pool, `SELECT FROM buzz.reminders WHERE id = $1 FOR SHARE`, got[0].id); err != nil {
		s.log.Error("reminder claim outcome not settled; claims will be recovered after their lease",
			"n", len(got), "err", err)
		return
	}
	// Those rolled back were claimed (the claim committed); the metrics count both, so claimed
	// still adds up to confirmed + rolled_back + lost + in flight.
	if n, err := s.rollback(ctx, got); err == nil {
		metrics.ReminderClaims.WithLabelValues("claimed").Add(float64(n))
	}
}
