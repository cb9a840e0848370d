package ops

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// SIGTERM while serve waits for PostgreSQL at start is an operator's stop: exit 0, saying it
// stopped, not "serve failed ... is it running?".
func TestSignalDuringStartupIsACleanStop(t *testing.T) {
	key, _ := testenv.NewKey()
	logPath := filepath.Join(t.TempDir(), "serve.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, testenv.Binary(t), "serve")
	cmd.Env = append(os.Environ(),
		"DATABASE_URL=postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=2",
		"BUZZ_RELAY_KEY="+key, "BUZZ_RELAY_KEY_FILE=", "BUZZ_LISTEN=127.0.0.1:0", "BUZZ_RELAY_URL=",
		"BUZZ_DB_WAIT=1m", "BUZZ_AUTO_MIGRATE=false", "BUZZ_METRICS_LISTEN=")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	log := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	testenv.WaitUntil(t, 30*time.Second, "serve to wait for PostgreSQL", func() bool {
		return strings.Contains(log(), "waiting for PostgreSQL")
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	if err != nil || !strings.Contains(log(), "stopped during start-up") || strings.Contains(log(), "serve failed") {
		t.Fatalf("SIGTERM while waiting for PostgreSQL: %v, want exit 0 and \"stopped during start-up\":\n%s", err, log())
	}
}

// A database that does not exist is said at once, not after BUZZ_DB_WAIT of "waiting for PostgreSQL".
func TestStartupNamesAMissingDatabaseAtOnce(t *testing.T) {
	key, _ := testenv.NewKey()
	u, err := url.Parse(testenv.ServerURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/buzz_no_such_database"
	began := time.Now()
	out, code := runBinary(t, []string{"DATABASE_URL=" + u.String(), "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=127.0.0.1:0", "BUZZ_DB_WAIT=1m"}, "serve")
	if code == 0 || !strings.Contains(out, "has no database") || !strings.Contains(out, "SQLSTATE 3D000") || time.Since(began) > 20*time.Second {
		t.Fatalf("serve on a missing database: exit %d after %s:\n%s", code, time.Since(began), out)
	}
}

// startServeCmd starts `buzzpg serve` on dbURL (on a free port, no operator listener) with env
// added, and returns it with a reader of what it logged so far.
func startServeCmd(t *testing.T, dbURL string, env ...string) (*exec.Cmd, func() string) {
	t.Helper()
	key, _ := testenv.NewKey()
	logPath := filepath.Join(t.TempDir(), "serve.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logf.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, testenv.Binary(t), "serve")
	cmd.Env = append(os.Environ(), "DATABASE_URL="+dbURL,
		"BUZZ_RELAY_KEY="+key, "BUZZ_RELAY_KEY_FILE=", "BUZZ_LISTEN=127.0.0.1:0", "BUZZ_RELAY_URL=", "BUZZ_METRICS_LISTEN=")
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, func() string { b, _ := os.ReadFile(logPath); return string(b) }
}

// exitCode waits for cmd and returns its exit code (-1 if a signal ended it).
func exitCode(t *testing.T, cmd *exec.Cmd) int {
	t.Helper()
	err := cmd.Wait()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	return cmd.ProcessState.ExitCode()
}

// A signal that cuts start-up short while it reads the schema version (the read waits for a lock
// the test holds) is an operator's stop like any other: exit 0, not a failure with advice to
// apply migrations.
func TestSignalWhileReadingTheSchemaIsACleanStop(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the test is over
	if _, err := tx.Exec(ctx, `LOCK TABLE `+db.MigrationsTable+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("sig%d", time.Now().UnixNano()%1e9)
	cmd, log := startServeCmd(t, dbURL, "BUZZ_AUTO_MIGRATE=false", "BUZZ_INSTANCE_ID="+id)
	testenv.WaitUntil(t, 30*time.Second, "the schema read to wait for the lock", func() bool {
		return testenv.MustInt(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND wait_event_type = 'Lock'`, "buzzpg-accept:"+id) > 0
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := exitCode(t, cmd); code != 0 || !strings.Contains(log(), "stopped during start-up") || strings.Contains(log(), "serve failed") {
		t.Fatalf("SIGTERM while reading the schema: exit %d, want 0 and \"stopped during start-up\":\n%s", code, log())
	}
}

// A start-up step that fails on its own as the signal comes is still a failure, which a deploy
// tool must see: here the migrations, waiting for golang-migrate's lock when SIGTERM arrives,
// then find the schema marked dirty (a migration failed) and stop start-up with exit 1.
func TestMigrationFailingAsTheSignalComesExitsNonZero(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	drv := testenv.MigrationDriver(t, dbURL)
	if err := drv.Lock(); err != nil {
		t.Fatal(err)
	}
	cmd, log := startServeCmd(t, dbURL, "BUZZ_AUTO_MIGRATE=true")
	testenv.WaitUntil(t, 30*time.Second, "the migrations to wait for golang-migrate's lock", func() bool {
		return testenv.MustInt(t, pool, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`) > 0
	})
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 30*time.Second, "serve to take the signal", func() bool {
		return strings.Contains(log(), "stopping once the migrations running now have ended")
	})
	if err := drv.SetVersion(int(db.LatestVersion()), true); err != nil {
		t.Fatal(err)
	}
	if err := drv.Unlock(); err != nil {
		t.Fatal(err)
	}
	if code := exitCode(t, cmd); code == 0 || !strings.Contains(log(), "dirty") || strings.Contains(log(), "stopped during start-up") {
		t.Fatalf("a migration failing as SIGTERM came: exit %d, want non-zero with the dirty advice:\n%s", code, log())
	}
}

// A signal that comes after the wal_level check but before auto-migrate begins stops start-up
// with the schema untouched: migrations take no context and, once begun, run to their end, so
// the process must not begin them on a stop the operator has already asked for. The process is
// held at the last point before them (a test hook) while the signal arrives.
func TestSignalBeforeMigrationsLeavesTheSchemaUntouched(t *testing.T) {
	dbURL := testenv.EmptyDB(t)
	hookDir := t.TempDir()
	const hook = "serve.before_migrations"
	cmd, log := startServeCmd(t, dbURL, "BUZZ_AUTO_MIGRATE=true", "BUZZ_HOOK_DIR="+hookDir, "BUZZ_HOOKS="+hook)
	hooks.Wait(t, hookDir, hook, 30*time.Second)
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// Not released: the hook gives up with the signal's cancellation, and a release written now
	// could be seen before the signal is, letting the process on as if none had come.
	if code := exitCode(t, cmd); code != 0 || !strings.Contains(log(), "stopped during start-up") {
		t.Fatalf("SIGTERM before migrations: exit %d, want 0 and \"stopped during start-up\":\n%s", code, log())
	}
	pool := testenv.Pool(t, dbURL)
	if n := testenv.MustInt(t, pool, `SELECT count(*) FROM pg_namespace WHERE nspname = 'buzz'`); n != 0 {
		t.Fatalf("migrations ran after the signal: schema buzz exists\n%s", log())
	}
	if n := testenv.MustInt(t, pool, `SELECT count(*) FROM pg_class WHERE relname = $1`, db.MigrationsTable); n != 0 {
		t.Fatalf("migrations began after the signal: %s exists\n%s", db.MigrationsTable, log())
	}
}
