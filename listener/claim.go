// Package listener holds what buzzpg's background components share. The components live in its
// subpackages: fanout (the replication tail), visibility (the NIP-DV snapshot publisher) and
// reminders (the NIP-ER scheduler). Both claimers (the outbox and the reminders) take rows with a
// short committed claim and a lease; this file is how a claim statement survives a stop and how
// one that broke off gives its rows back.
package listener

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// claimGrace is how long a claim statement may go on once its caller is stopping.
var claimGrace = 5 * time.Second // a variable for tests

// ClaimContext is the context a claim statement runs under: it keeps ctx's values (test hooks,
// instance ids) and outlives ctx's cancellation by claimGrace. pgx answers a cancelled context
// by closing the connection on our side only; the server still runs the statement and commits
// the claim, and the rows it returns never reach us, so nobody could release them: they would sit
// out the whole lease. A claim is a few milliseconds, so shutdown waits for it and then gives
// its rows back. Before any stop there is no deadline at all, as for any other statement: a
// client-side timeout would lose a committed claim the same way.
func ClaimContext(ctx context.Context) (context.Context, context.CancelFunc) {
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(claimGrace, cancel) })
	return cctx, func() { stop(); cancel() }
}

// Giving back what a claim statement took when it broke off after some of its rows had arrived
// (a connection lost mid-result, a FATAL, a row that would not scan). The claim's commit outcome
// is unknown then, but the claim identifies its rows (the reminders' stamps, the outbox claim id),
// and both undo statements are fenced by exactly that: committed, the rows go back at once
// instead of after the whole lease; not committed, they match nothing and nothing changes.

// UndoContext bounds an undo by claimGrace on its own: the caller's context may be the one whose
// cancellation broke the claim off (a stop), and the undo is what keeps the rows from waiting out
// the lease.
func UndoContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), claimGrace)
}

// SettledByError reports whether err says the claim took nothing: PostgreSQL answered with an
// ERROR (the statement rolled back), or the statement never left us.
func SettledByError(err error) bool {
	return IsServerError(err) || pgconn.SafeToRetry(err)
}

// AwaitClaimEnd returns once the transaction of a claim that took row key has ended. The claim
// may still be running on the server when we see our connection die (we closed it, or a network
// fault reached us first; pgx then sends a cancel request, which may be lost or come too late):
// an undo then would match nothing, and the claim's commit right after would hold the rows for
// the lease all the same. Every row the claim took stays locked by its transaction until it
// commits or aborts, so a share lock on any one of them (lockOne, with key as $1) is granted only
// then; the undo that follows sees the claim's outcome. The lock ends with this statement, so no
// lock is held while waiting for another (no deadlock). A claim still running at the end of ctx
// (its backend stuck on a dead network) is left to lease recovery.
func AwaitClaimEnd(ctx context.Context, pool *pgxpool.Pool, lockOne string, key string) error {
	_, err := pool.Exec(ctx, lockOne, key)
	return err
}

// IsServerError reports whether PostgreSQL answered with an ERROR: the statement (and its implicit
// transaction) was then rolled back for certain. A FATAL (e.g. pg_terminate_backend) may arrive
// after the commit already happened, so it counts as an unknown outcome. Severity is translated
// by lc_messages ("FEHLER"); the unlocalized field is not.
func IsServerError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	sev := pgErr.SeverityUnlocalized
	if sev == "" { // servers before 9.6
		sev = pgErr.Severity
	}
	return sev == "ERROR"
}
