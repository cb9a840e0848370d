package visibility

import (
	"context"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/listener"
)

// HookClaimUndone is the pause point after a broken-off claim was given back (or the attempt
// gave up): tests wait there.
const HookClaimUndone = "visibility.claim_undone"

// undoClaim releases the rows of claim id, a claim statement that broke off after got had
// arrived (perhaps none). The release touches only rows still held under that id, which no other
// claim uses, so it reaches the rows that never arrived as well. With none arrived it still helps:
// PostgreSQL sends a result that fits its 8 kB output buffer only after the commit, so a break
// before the first row most often follows a committed claim. Only then, with no row to wait on,
// can a claim still running commit after the release and keep its rows for the lease.
func (p *Publisher) undoClaim(ctx context.Context, id string, got []claimed, cause error) {
	if listener.SettledByError(cause) {
		return
	}
	ctx, cancel := listener.UndoContext(ctx)
	defer cancel()
	defer hooks.At(context.WithValue(ctx, publisherKey{}, p.cfg.InstanceID), HookClaimUndone)
	if len(got) > 0 {
		if err := listener.AwaitClaimEnd(ctx, p.pool, `SELECT FROM buzz.visibility_outbox WHERE viewer = $1 FOR SHARE`, got[0].viewer); err != nil {
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
