package db

import (
	"context"
	"strconv"

	"github.com/golang-migrate/migrate/v4/database"
	"github.com/jackc/pgx/v5"
)

// Querier is what MigrationRunning needs of a pool or a connection.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// migrationLockIDs are the advisory lock keys golang-migrate's pgx/v5 driver may hold while it
// migrates this database: GenerateAdvisoryLockId over (schema, table, database name), where the
// driver's "database name" is the path of the URL it was given ("/buzzpg") or, for a URL without
// one, current_database() ("buzzpg"). Both are candidates: the operator's `buzzpg migrate up`
// need not use the same URL shape as this process. The schema is current_schema() of the
// migrating connection; the same role and URL give the same one, and "public" covers a role
// whose search_path differs.
func migrationLockIDs(dbname, schema string) []int64 {
	var ids []int64
	for _, s := range uniq(schema, "public") {
		for _, d := range []string{"/" + dbname, dbname} {
			id, err := database.GenerateAdvisoryLockId(d, s, MigrationsTable)
			if err != nil {
				continue
			}
			if n, err := strconv.ParseInt(id, 10, 64); err == nil {
				ids = append(ids, n)
			}
		}
	}
	return ids
}

func uniq(a, b string) []string {
	if a == b || a == "" {
		return []string{b}
	}
	return []string{a, b}
}

// MigrationRunning reports whether some session holds golang-migrate's advisory lock on this
// database: a `migrate up` (or a starting process migrating) is under way. golang-migrate records
// (N, dirty) before it runs file N and (N, clean) after, all under that lock, so a dirty version
// with the lock held is a migration in progress, and without it a migration that failed.
// pg_locks is read, never the lock taken: a probe must not queue behind, or in front of, a migrator.
func MigrationRunning(ctx context.Context, q Querier) (bool, error) {
	var dbname, schema string
	if err := q.QueryRow(ctx, `SELECT current_database(), coalesce(current_schema(), '')`).Scan(&dbname, &schema); err != nil {
		return false, err
	}
	var held bool
	// A bigint advisory key shows as classid (high half), objid (low half), objsubid 1.
	err := q.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM pg_locks
		                WHERE locktype = 'advisory' AND granted AND objsubid = 1
		                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		                  AND (classid::int8 << 32 | objid::int8) = ANY($1::int8[]))`,
		migrationLockIDs(dbname, schema)).Scan(&held)
	return held, err
}
