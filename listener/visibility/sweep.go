package visibility

import (
	"context"
	"time"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// sweep repairs the queue from the state (pending viewers without an outbox row get one) and
// refreshes the lag gauges. Draining follows.
func (p *Publisher) sweep(ctx context.Context) {
	p.stats.sweeps.Add(1)
	var repaired int
	if err := p.pool.QueryRow(ctx, `SELECT buzz.sweep_visibility()`).Scan(&repaired); err != nil {
		if ctx.Err() == nil {
			p.log.Warn("visibility sweep failed", "err", err)
		}
		return
	}
	if repaired > 0 {
		p.stats.repaired.Add(int64(repaired))
		p.log.Info("visibility sweep re-created outbox rows from the state", "rows", repaired)
	}
	// Rows in backoff (or under a lease) wake nobody when they come due: their NOTIFY fired long
	// ago, perhaps to a process that is gone. Wake a worker then, if that is before the next sweep.
	var due *float64
	if err := p.pool.QueryRow(ctx, `SELECT extract(epoch FROM min(greatest(available_at, coalesce(lease_until, available_at))) - now())
		FROM buzz.visibility_outbox WHERE available_at > now() OR lease_until > now()`).Scan(&due); err == nil && due != nil {
		if d := time.Duration(*due*float64(time.Second)) + time.Millisecond; d < p.cfg.SweepInterval {
			time.AfterFunc(d, p.kickDrain)
		}
	}
	var pending int64
	var oldest *float64
	if err := p.pool.QueryRow(ctx, `SELECT pending_viewers, oldest_pending_seconds FROM buzz.visibility_lag()`).
		Scan(&pending, &oldest); err == nil {
		metrics.OutboxDepth.Set(float64(pending))
		if oldest != nil {
			metrics.OutboxOldestSeconds.Set(*oldest)
		} else {
			metrics.OutboxOldestSeconds.Set(0)
		}
	}
}
