package db

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/golang-migrate/migrate/v4"
	_ "github.com/golang-migrate/migrate/v4/database/pgx/v5" // registers pgx5://
	"github.com/golang-migrate/migrate/v4/source/iofs"

	buzzsql "github.com/buzzpg/buzzpg/sql"
)

// MigrationsTable is pinned so every binary version and the stock migrate CLI agree on it.
const MigrationsTable = "buzz_schema_migrations"

// MigrateLockTimeout bounds how long a starting process waits for another one that is applying
// migrations; long enough for a cold start of several processes on an empty database.
const MigrateLockTimeout = 2 * time.Minute

// NewMigrator is the one migrator construction used by `serve`, `migrate` and tests.
func NewMigrator(databaseURL string, log *slog.Logger) (*migrate.Migrate, error) {
	src, err := iofs.New(buzzsql.FS, ".")
	if err != nil {
		return nil, err
	}
	u, err := MigrateURL(databaseURL)
	if err != nil {
		return nil, err
	}
	m, err := migrate.NewWithSourceInstance("iofs", src, u)
	if err != nil {
		return nil, fmt.Errorf("migrations: cannot connect: %w", err)
	}
	m.LockTimeout = MigrateLockTimeout
	if log != nil {
		m.Log = migrateLogger{log}
	}
	return m, nil
}

// MigrateURL turns a postgres:// URL into the pgx5:// form golang-migrate's pgx/v5 driver wants,
// with the pinned migrations table. x-multi-statement stays off: it would split inside $$ bodies.
// Exported for tests that drive golang-migrate's driver (its lock, its version row) directly.
func MigrateURL(databaseURL string) (string, error) {
	u, err := url.Parse(databaseURL)
	if err != nil || u.Scheme == "" {
		// key=value DSNs are not supported by golang-migrate.
		return "", fmt.Errorf("DATABASE_URL must be a postgres:// URL for migrations")
	}
	switch u.Scheme {
	case "postgres", "postgresql", "pgx5":
		u.Scheme = "pgx5"
	default:
		return "", fmt.Errorf("DATABASE_URL scheme %q not supported (use postgres://)", u.Scheme)
	}
	q := u.Query()
	q.Set("x-migrations-table", MigrationsTable)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// SchemaNewerError says the database's schema is newer than this binary's migrations: a newer
// binary migrated it (a rolling deploy, or a rollback of the binary). There is nothing to apply,
// and golang-migrate, which cannot find the applied version among our files, would fail with
// "no migration found for version N".
type SchemaNewerError struct{ Have, Latest uint }

func (e *SchemaNewerError) Error() string {
	return fmt.Sprintf("migrations: the schema is at version %d, newer than this binary's %d: nothing to apply (a newer buzzpg migrated it; migrate with that one, or `migrate down` with it to go back)", e.Have, e.Latest)
}

// MigrateUp applies all pending migrations. Concurrent callers serialise on golang-migrate's
// advisory lock; the losers find nothing to do. A clean schema newer than this binary's is a
// *SchemaNewerError.
func MigrateUp(databaseURL string, log *slog.Logger) error {
	m, err := NewMigrator(databaseURL, log)
	if err != nil {
		return err
	}
	defer m.Close()
	if v, dirty, err := m.Version(); err == nil && !dirty && v > LatestVersion() {
		return &SchemaNewerError{Have: v, Latest: LatestVersion()}
	}
	if err := m.Up(); err != nil && !errors.Is(err, migrate.ErrNoChange) {
		// A newer binary may have migrated past us while we waited for the lock.
		if v, dirty, verr := m.Version(); verr == nil && !dirty && v > LatestVersion() {
			return &SchemaNewerError{Have: v, Latest: LatestVersion()}
		}
		var dirty migrate.ErrDirty
		if errors.As(err, &dirty) {
			return fmt.Errorf("migrations: %s", DirtyAdvice(int(dirty.Version)))
		}
		// golang-migrate's errors do not unwrap to the PostgreSQL error. A relay's role (buzz_relay)
		// may read the version but not write it: it was refused before any migration ran.
		if strings.Contains(err.Error(), "SQLSTATE 42501") {
			return fmt.Errorf("migrations: this role may not migrate (%w): run `buzzpg migrate up` as the schema's owner, and start relays with BUZZ_AUTO_MIGRATE=false", err)
		}
		return fmt.Errorf("migrations: %w", err)
	}
	return nil
}

// DirtyAdvice says what to do about a schema marked dirty at version v. Each migration file runs as
// one transaction, so the failed one left nothing behind; golang-migrate records the target
// version before running a file, so the schema is one version below v after a failed up, and one
// above it after a failed down.
func DirtyAdvice(v int) string {
	below := v - 1
	if below == 0 {
		below = -1 // no version at all
	}
	return fmt.Sprintf("schema marked dirty at version %d: a migration failed and was rolled back. Fix the cause, then `buzzpg migrate force %d` if `migrate up` failed (or `force %d` if `migrate down` failed), and run it again", v, below, v+1)
}

// SchemaStatus reports the applied version and whether it is the newest embedded one.
func SchemaStatus(databaseURL string) (version uint, dirty, current bool, err error) {
	m, err := NewMigrator(databaseURL, nil)
	if err != nil {
		return 0, false, false, err
	}
	defer m.Close()
	version, dirty, err = m.Version()
	if errors.Is(err, migrate.ErrNilVersion) {
		return 0, false, false, nil
	}
	if err != nil {
		return 0, false, false, err
	}
	return version, dirty, !dirty && version == LatestVersion(), nil
}

// LatestVersion is the highest embedded migration version.
func LatestVersion() uint {
	entries, _ := buzzsql.FS.ReadDir(".")
	var latest uint
	for _, e := range entries {
		var v uint
		if _, err := fmt.Sscanf(e.Name(), "%d_", &v); err == nil && strings.HasSuffix(e.Name(), ".up.sql") && v > latest {
			latest = v
		}
	}
	return latest
}

type migrateLogger struct{ l *slog.Logger }

func (m migrateLogger) Printf(format string, v ...any) {
	m.l.Info(strings.TrimSpace(fmt.Sprintf(format, v...)), "component", "migrate")
}
func (m migrateLogger) Verbose() bool { return false }
