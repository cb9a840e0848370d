package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Querier is what the Must* query helpers run on: a pool, a connection or a transaction.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// MustScalar runs sql, which must return exactly one row of one column, and returns that value.
// Any error (the query's, the scan's, rows.Err, no row or several rows) fails the test: a check
// built on it can never pass on the zero value of a query that did not run.
// Call it from the test's goroutine only.
func MustScalar[T any](t testing.TB, q Querier, sql string, args ...any) T {
	t.Helper()
	rows, err := q.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	v, err := pgx.CollectExactlyOneRow(rows, pgx.RowTo[T])
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	return v
}

// MustInt is MustScalar for an integer (count(*), a pid, a generation).
func MustInt(t testing.TB, q Querier, sql string, args ...any) int {
	t.Helper()
	return MustScalar[int](t, q, sql, args...)
}

// MustColumn runs sql, which must return one column, and returns its values in order. Any error
// (the query's, a scan's or rows.Err) fails the test. Call it from the test's goroutine only.
func MustColumn[T any](t testing.TB, q Querier, sql string, args ...any) []T {
	t.Helper()
	rows, err := q.Query(context.Background(), sql, args...)
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[T])
	if err != nil {
		t.Fatalf("query %q: %v", sql, err)
	}
	return vs
}

// MustScan scans the single row of a QueryRow into dest; any error (the query's, the scan's, no
// row) fails the test. Call it from the test's goroutine only.
func MustScan(t testing.TB, row pgx.Row, dest ...any) {
	t.Helper()
	if err := row.Scan(dest...); err != nil {
		t.Fatalf("query row: %v", err)
	}
}
