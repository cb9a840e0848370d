package store

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// StatisticsEvery is how often RefreshStatistics asks PostgreSQL whether a hot table needs ANALYZE.
const StatisticsEvery = 2 * time.Second

// RefreshStatistics calls buzz.refresh_statistics (sql/0007_upkeep.up.sql) every interval until ctx ends, so
// that REQ plans right after a bulk load use the indexes, not a sort of the whole table: a table
// that grew from empty (buzz.events, buzz.event_tags which #x filters walk, buzz.members) has no
// statistics until autovacuum gets to it. A failed call is logged and
// tried again at the next tick; it never stops the process.
func RefreshStatistics(ctx context.Context, pool *pgxpool.Pool, interval time.Duration, log *slog.Logger) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		var done []string
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := pool.QueryRow(cctx, `SELECT buzz.refresh_statistics()`).Scan(&done)
		cancel()
		switch {
		case err != nil && ctx.Err() == nil:
			log.Warn("refreshing planner statistics failed", "err", err)
		case len(done) > 0:
			log.Debug("planner statistics refreshed", "tables", done)
		}
	}
}
