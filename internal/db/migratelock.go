package db

import (
	"context"
	"slices"
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
// migrating connection: the schema that holds the table (golang-migrate creates it there before it
// locks), and "public" for a database that has none yet. Our own pools' search_path (SearchPath)
// is not the migrating role's, so current_schema() would not say.
func migrationLockIDs(dbname string, schemas []string) []int64 {
	var ids []int64
	for _, s := range uniq(append(schemas, "public")) {
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

func uniq(in []string) []string {
	var out []string
	for _, s := range in {
		if s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// MigrationRunning reports whether some session holds golang-migrate's advisory lock on this
// database: a `migrate up` (or a starting process migrating) is under way. golang-migrate records
// (N, dirty) before it runs file N and (N, clean) after, all under that lock, so a dirty version
// with the lock held is a migration in progress, and without it a migration that failed.
// pg_locks is read, never the lock taken: a probe must not queue behind, or in front of, a migrator.
func MigrationRunning(ctx context.Context, q Querier) (bool, error) {
	var dbname string
	var schemas []string
	if err := q.QueryRow(ctx, `SELECT current_database(), coalesce(array_agg(n.nspname::text), '{}')
		  FROM (SELECT 1) one
		  LEFT JOIN pg_class c ON c.relname = $1 AND c.relkind IN ('r', 'p')
		  LEFT JOIN pg_namespace n ON n.oid = c.relnamespace`, MigrationsTable).Scan(&dbname, &schemas); err != nil {
		return false, err
	}
	var held bool
	// A bigint advisory key shows as classid (high half), objid (low half), objsubid 1.
	err := q.QueryRow(ctx, `
		SELECT EXISTS (SELECT 1 FROM pg_locks
		                WHERE locktype = 'advisory' AND granted AND objsubid = 1
		                  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
		                  AND (classid::int8 << 32 | objid::int8) = ANY($1::int8[]))`,
		migrationLockIDs(dbname, schemas)).Scan(&held)
	return held, err
}
