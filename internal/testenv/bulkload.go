package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// Execer is what BulkLoadEvents runs on: a pool, or one connection when the test needs the
// same session afterwards (its statistics flush, for one).
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// BulkLoadEvents stores n public kind 1 rows straight into buzz.events (created_at ascending,
// authors pubkeys in turn; not signed), as a bulk load leaves the table: with no statistics, and
// with autovacuum off on it so that none arrive during the test.
func BulkLoadEvents(t testing.TB, ex Execer, n, authors int) {
	t.Helper()
	ctx := context.Background()
	if _, err := ex.Exec(ctx, `ALTER TABLE buzz.events SET (autovacuum_enabled = false)`); err != nil {
		t.Fatal(err)
	}
	if _, err := ex.Exec(ctx, `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		SELECT lpad(to_hex(i), 64, '0'), lpad(to_hex(i % $2), 64, '0'), 1700000000 + i, 1, '[]', 'x', repeat('0', 128)
		  FROM generate_series(1, $1) i`, n, authors); err != nil {
		t.Fatal(err)
	}
}
