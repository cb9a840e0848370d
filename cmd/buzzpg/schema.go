package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
)

// checkSchema refuses to serve a database whose schema is missing, dirty or older than this
// binary needs, with what to do about it. A newer schema is served: during a rolling deploy the
// migrations run first and the old binaries keep serving until they are replaced.
//
// Dirty has two meanings. golang-migrate, under its advisory lock, records (N, dirty) and commits
// it, runs file N in one transaction, then records (N, clean): while the lock is held, dirty is a
// migration in progress, and the schema still the one below N (a down from N+1 records (N, dirty)
// first: counting it as N-1 is then one too low, which can only make a process less ready). Once
// the lock is gone, dirty is a migration that failed. A schema too old while a migration runs is
// reported as errMigrating, which start-up waits out.
func checkSchema(ctx context.Context, pool *pgxpool.Pool) error {
	var version int64
	var dirty bool
	err := pool.QueryRow(ctx, `SELECT version, dirty FROM `+db.MigrationsTable+` LIMIT 1`).Scan(&version, &dirty)
	if err != nil {
		if ctx.Err() != nil {
			// Cut short (a signal at start-up, a probe's timeout): no news about the schema.
			return fmt.Errorf("schema: cannot read %s: %w", db.MigrationsTable, err)
		}
		return fmt.Errorf("schema: cannot read %s (%v): apply migrations with `buzzpg migrate up` or start with BUZZ_AUTO_MIGRATE=true", db.MigrationsTable, err)
	}
	latest := int64(db.LatestVersion())
	if !dirty && version >= latest {
		return nil
	}
	hooks.At(ctx, hookSchemaRead)
	running, err := db.MigrationRunning(ctx, pool)
	if err != nil {
		return fmt.Errorf("schema: at version %d (dirty: %v), and cannot tell from pg_locks whether a migration is running: %w", version, dirty, err)
	}
	if dirty && !running {
		// The migrator commits (N, clean) and only then gives its lock back: a migration that
		// ended between our two reads shows as dirty with no lock held. Read again, now that the
		// lock is seen free, before calling it failed.
		var v2 int64
		var d2 bool
		hooks.At(ctx, hookSchemaReread)
		if err := pool.QueryRow(ctx, `SELECT version, dirty FROM `+db.MigrationsTable+` LIMIT 1`).Scan(&v2, &d2); err != nil {
			// Not read: no news, and certainly not proof of a failed migration (a signal here
			// must not turn into "run migrate force").
			return fmt.Errorf("schema: cannot read %s again: %w", db.MigrationsTable, err)
		}
		if v2 != version || !d2 {
			return checkSchema(ctx, pool)
		}
		return fmt.Errorf("schema: %s", db.DirtyAdvice(int(version)))
	}
	effective := version
	if dirty {
		effective = version - 1
	}
	switch {
	case effective >= latest:
		return nil
	case running:
		return fmt.Errorf("schema: database is at version %d, this binary needs %d, and %w (golang-migrate's lock is held; %s says version %d, dirty %v)", effective, latest, errMigrating, db.MigrationsTable, version, dirty)
	}
	return fmt.Errorf("schema: database is at version %d, this binary needs %d: run `buzzpg migrate up`", version, latest)
}

// hookSchemaRead is where a test ends a migration between checkSchema's read of the version and
// its look at the lock.
const hookSchemaRead = "serve.schema_read"

// hookBeforeMigrations is just before auto-migrate begins, the last point a signal stops start-up
// without the schema changing.
const hookBeforeMigrations = "serve.before_migrations"

// hookSchemaReread is just before the second read of a version seen dirty with the lock free.
const hookSchemaReread = "serve.schema_reread"

// errMigrating marks a schema that is not current yet while a migration runs.
var errMigrating = errors.New("a migration is in progress")

// waitForSchema is checkSchema at start-up. A migration in progress (a deploy's `buzzpg migrate
// up`, a peer's auto-migrate) is waited for, up to the migrator's own lock timeout, instead of
// ending the start with advice about a failure that did not happen.
func waitForSchema(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	deadline := time.Now().Add(db.MigrateLockTimeout)
	for logged := false; ; logged = true {
		err := checkSchema(ctx, pool)
		if !errors.Is(err, errMigrating) {
			return err
		}
		if !logged {
			log.Warn("waiting for a migration in progress", "err", err, "for", db.MigrateLockTimeout)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w, for over %s: start this process again once it has finished (`buzzpg migrate version` says where it stands)", err, db.MigrateLockTimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// publishSettings records the settings SQL enforces too (buzz.config is shared by every process).
// The last process to start wins, so a replacement that differs from what another process wrote
// is said loudly: with a different relay key, the snapshots of processes still on the old key are
// refused from now on (a key rotation does this on purpose; a misconfigured replica by accident).
func publishSettings(ctx context.Context, pool *pgxpool.Pool, pk string, cfg serveConfig, log *slog.Logger) error {
	// settings_written_by names the last writer; before any process wrote, the values are the
	// migration's defaults and replacing them is no news, except a relay key: one is set only by
	// a process (deployments from before settings_written_by existed have a key but no writer).
	rows, err := pool.Query(ctx, `
		WITH prev AS (SELECT value AS writer FROM buzz.config WHERE key = 'settings_written_by'),
		     old AS (SELECT key, value FROM buzz.config
		              WHERE key IN ('relay_pubkey', 'max_future_seconds', 'reminder_horizon_seconds')),
		     up AS (INSERT INTO buzz.config(key, value) VALUES
		              ('relay_pubkey', $1), ('max_future_seconds', $2), ('reminder_horizon_seconds', $3),
		              ('settings_written_by', $4)
		            ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
		            RETURNING key, value)
		SELECT up.key, old.value, up.value, coalesce((SELECT writer FROM prev), 'unknown')
		  FROM up JOIN old USING (key)
		 WHERE old.value IS DISTINCT FROM up.value
		   AND (EXISTS (SELECT 1 FROM prev) OR (up.key = 'relay_pubkey' AND old.value <> ''))`,
		pk, fmt.Sprint(cfg.MaxFutureSeconds), fmt.Sprint(int64(cfg.ReminderHorizon/time.Second)), cfg.InstanceID)
	if err != nil {
		return fmt.Errorf("cannot write buzz.config: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var key, was, now, writer string
		if err := rows.Scan(&key, &was, &now, &writer); err != nil {
			return fmt.Errorf("cannot write buzz.config: %w", err)
		}
		log.Warn("this process replaces a shared setting another process wrote; every process should run with the same value",
			"setting", key, "was", was, "now", now, "written_by", writer)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("cannot write buzz.config: %w", err)
	}
	return nil
}
