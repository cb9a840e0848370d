package listener

import (
	"context"
	"time"
)

// claimTimeout bounds a claim statement that shutdown no longer cancels.
const claimTimeout = 5 * time.Second

// claimContext is the context a claim statement runs under: it keeps ctx's values (test hooks,
// instance ids) but not its cancellation. pgx answers a cancelled context by closing the
// connection on our side only; the server still runs the statement and commits the claim, and
// the rows it returns never reach us, so nobody could release them: they would sit out the whole
// lease. A claim is a few milliseconds, so shutdown waits for it and then gives its rows back.
func claimContext(ctx context.Context, lease time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), min(claimTimeout, lease))
}
