package listener

// Giving back what a claim statement took when it broke off after some of its rows had arrived
// (a connection lost mid-result, a FATAL, a row that would not scan). The claim's commit outcome
// is unknown then, but the claim identifies its rows (the reminders' stamps, the outbox claim id),
// and both undo statements are fenced by exactly that: committed, the rows go back at once
// instead of after the whole lease; not committed, they match nothing and nothing changes.

import (
	"context"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// Hook points after a broken-off claim was given back (or the attempt gave up): tests wait there.
const (
	HookReminderClaimUndone = "reminder.claim_undone"
	HookSnapshotClaimUndone = "visibility.claim_undone"
)

// undoContext bounds an undo by claimGrace on its own: the caller's context may be the one whose
// cancellation broke the claim off (a stop), and the undo is what keeps the rows from waiting out
// the lease.
func undoContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), claimGrace)
}

// settledByError reports whether err says the claim took nothing: PostgreSQL answered with an
// ERROR (the statement rolled back), or the statement never left us.
func settledByError(err error) bool {
	return isServerError(err) || pgconn.SafeToRetry(err)
}

// awaitClaimEnd returns once the transaction of a claim that took row key has ended. The claim
// may still be running on the server when we see our connection die (we closed it, or a network
// fault reached us first; pgx then sends a cancel request, which may be lost or come too late):
// an undo then would match nothing, and the claim's commit right after would hold the rows for
// the lease all the same. Every row the claim took stays locked by its
// transaction until it commits or aborts, so a share lock on any one of them is granted only
// then; the undo that follows sees the claim's outcome. The lock ends with this statement, so no
// lock is held while waiting for another (no deadlock). A claim still running at the end of ctx
// (its backend stuck on a dead network) is left to lease recovery, as before.
func awaitClaimEnd(ctx context.Context, pool *pgxpool.Pool, lockOne string, key string) error {
	_, err := pool.Exec(ctx, lockOne, key)
	return err
}

// undoClaim rolls back the claims of a claim statement that broke off after got had arrived.
// Rows taken but not received stay to lease recovery: their stamps never reached us.
//
// DESIGN.md has a scheduler re-read by stamp, never roll back, after a commit whose outcome is
// unknown: that is the CONFIRM, whose commit emits the due signal, so a rollback there could
// re-arm a signal that went out and have it emitted twice. A claim emits nothing, and no confirm
// of these rows can have run (we never started one; it needs our stamps, which nobody else has),
// so re-arming an unconfirmed claim under our stamp only makes the reminder claimable again; its
// next claim gets a new stamp and emits it once.
func (s *Scheduler) undoClaim(ctx context.Context, got []claim, cause error) {
	if len(got) == 0 || settledByError(cause) {
		return
	}
	ctx, cancel := undoContext(ctx)
	defer cancel()
	defer hooks.At(ctx, HookReminderClaimUndone)
	s.log.Warn("reminder claim broke off after rows arrived; rolling back the claims received",
		"n", len(got), "err", cause)
	if err := awaitClaimEnd(ctx, s.pool, `SELECT FROM buzz.reminders WHERE id = $1 FOR SHARE`, got[0].id); err != nil {
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

// undoClaim releases the rows of claim id, a claim statement that broke off after got had
// arrived (perhaps none). The release touches only rows still held under that id, which no other
// claim uses, so it reaches the rows that never arrived as well. With none arrived it still helps:
// PostgreSQL sends a result that fits its 8 kB output buffer only after the commit, so a break
// before the first row most often follows a committed claim. Only then, with no row to wait on,
// can a claim still running commit after the release and keep its rows for the lease.
func (p *Publisher) undoClaim(ctx context.Context, id string, got []claimed, cause error) {
	if settledByError(cause) {
		return
	}
	ctx, cancel := undoContext(ctx)
	defer cancel()
	defer hooks.At(context.WithValue(ctx, publisherKey{}, p.cfg.InstanceID), HookSnapshotClaimUndone)
	if len(got) > 0 {
		if err := awaitClaimEnd(ctx, p.pool, `SELECT FROM buzz.visibility_outbox WHERE viewer = $1 FOR SHARE`, got[0].viewer); err != nil {
			p.log.Error("snapshot claim outcome not settled; rows wait for their lease",
				"claim", id, "received", len(got), "err", err)
			return
		}
	}
	var n int
	if err := p.pool.QueryRow(ctx, `SELECT buzz.release_visibility_claims($1::uuid[])`, []string{id}).Scan(&n); err != nil {
		p.log.Error("snapshot claim broke off and its release failed; rows wait for their lease",
			"claim", id, "received", len(got), "cause", cause, "err", err)
		return
	}
	p.log.Warn("snapshot claim broke off; released its rows", "claim", id, "received", len(got),
		"released", n, "err", cause)
}
