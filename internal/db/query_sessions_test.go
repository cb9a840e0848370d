package db_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Right after a bulk load, before any ANALYZE, a REQ session walks the index in the REQ's order
// instead of collecting every match and sorting it (db.QuerySessions): the plan does not depend
// on whether statistics caught up.
func TestQuerySessionsWalkIndexesWithoutStatistics(t *testing.T) {
	ctx := context.Background()
	url := testenv.FreshDB(t)
	testenv.BulkLoadEvents(t, testenv.Pool(t, url), 20000, 20)
	pool, err := db.NewPool(ctx, url, "query-sessions-test", 1, db.QuerySessions)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	plan := explain(t, pool, `SELECT e.id FROM buzz.events e WHERE e.kind = 1 AND e.scope = '*'
		ORDER BY e.created_at DESC, e.id LIMIT 100`)
	if !strings.Contains(plan, "Index Scan using events_kind_idx") || strings.Contains(plan, "Sort") {
		t.Fatalf("a kinds+limit REQ before statistics:\n%s", plan)
	}
}

func explain(t *testing.T, pool *pgxpool.Pool, query string) string {
	t.Helper()
	rows, err := pool.Query(context.Background(), "EXPLAIN "+query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var l string
		if err := rows.Scan(&l); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, l)
	}
	return strings.Join(lines, "\n")
}
