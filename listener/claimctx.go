package listener

import (
	"context"
	"time"
)

// claimGrace is how long a claim statement may go on once its caller is stopping.
var claimGrace = 5 * time.Second // a variable for tests

// claimContext is the context a claim statement runs under: it keeps ctx's values (test hooks,
// instance ids) and outlives ctx's cancellation by claimGrace. pgx answers a cancelled context
// by closing the connection on our side only; the server still runs the statement and commits
// the claim, and the rows it returns never reach us, so nobody could release them: they would sit
// out the whole lease. A claim is a few milliseconds, so shutdown waits for it and then gives
// its rows back. Before any stop there is no deadline at all, as for any other statement: a
// client-side timeout would lose a committed claim the same way.
func claimContext(ctx context.Context) (context.Context, context.CancelFunc) {
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(claimGrace, cancel) })
	return cctx, func() { stop(); cancel() }
}
