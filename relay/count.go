package relay

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
)

// handleCount answers NIP-45 COUNT with the same gates as REQ. A refusal or a failure is a
// CLOSED (NIP-45) that also ends a REQ of the same id (closeID).
func (c *conn) handleCount(subID string, filters []nostr.Filter) {
	cfs, ok := c.admitFilters("COUNT", subID, filters)
	if !ok {
		return
	}
	if !c.acquireQuery(c.ctx) {
		return
	}
	go func() {
		defer c.releaseQuery()
		defer c.recoverQuery(subID, nil)
		n, err := c.count(c.ctx, cfs)
		if err != nil {
			if c.ctx.Err() != nil {
				return
			}
			if !isTimeout(err) {
				c.log.Error("COUNT query failed", "sub", subID, "err", err)
			}
			c.closeID(subID, queryErrorReason(err))
			return
		}
		c.send(marshalCount(subID, n))
	}()
}

func (c *conn) count(ctx context.Context, cfs []*compiledFilter) (int64, error) {
	sql, args := countSQL(cfs, c.authedList())
	if sql == "" {
		return 0, nil
	}
	var n int64
	err := c.runQuery(ctx, "COUNT", func(ctx context.Context, pc *pgxpool.Conn) error {
		return pc.QueryRow(ctx, sql, args...).Scan(&n)
	})
	return n, err
}
