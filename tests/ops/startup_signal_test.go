package ops

import (
	"context"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

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
