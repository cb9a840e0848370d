package store_test

import (
	"context"
	"testing"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// buzz.refresh_statistics analyzes a table that grew with a small sample (statistics target 10,
// sql/0007_upkeep.up.sql): it runs beside the load that grew it, and its CPU grows with the sample.
// 3,000 distinct created_at values give a histogram of 101 bounds at the default target, 11 at 10.
func TestRefreshStatisticsSamplesSmall(t *testing.T) {
	ctx := context.Background()
	pool, err := testenv.Pool(t, testenv.FreshDB(t)).Acquire(ctx) // one session: its statistics flush below
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Release()
	testenv.BulkLoadEvents(t, pool, 3000, 50)
	// The insert's counts reach pg_stat_user_tables, which refresh_statistics reads, when the
	// session is next idle: before the next statement.
	if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	var done []string
	if err := pool.QueryRow(ctx, `SELECT buzz.refresh_statistics()`).Scan(&done); err != nil {
		t.Fatal(err)
	}
	if len(done) == 0 || done[0] != "events" {
		t.Fatalf("refresh_statistics analyzed %v, want events first", done)
	}
	var bounds int
	var target string
	if err := pool.QueryRow(ctx, `
		SELECT coalesce(array_length(histogram_bounds::text::text[], 1), 0) FROM pg_stats
		 WHERE schemaname = 'buzz' AND tablename = 'events' AND attname = 'created_at'`).Scan(&bounds); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SHOW default_statistics_target`).Scan(&target); err != nil {
		t.Fatal(err)
	}
	if bounds < 2 || bounds > 11 {
		t.Fatalf("created_at histogram of %d bounds, want 2 to 11 (target 10); the session's target is %s", bounds, target)
	}
}
