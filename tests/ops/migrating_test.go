package ops

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// A `buzzpg migrate up` to a version past this binary's runs while the relay serves: golang-migrate
// holds its lock and has recorded (latest+1, dirty) while the file runs. The schema is still the
// latest one, so /readyz stays 200 the whole time. Once the lock is gone with dirty still set, the
// migration failed, and /readyz says so.
func TestReadyWhileAMigrationRuns(t *testing.T) {
	url := testenv.FreshDB(t)
	opsAddr := freeAddr(t)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, Env: map[string]string{"BUZZ_METRICS_LISTEN": opsAddr}})
	ops := "http://" + opsAddr

	drv := testenv.MigrationDriver(t, url)
	if err := drv.Lock(); err != nil {
		t.Fatal(err)
	}
	next := int(db.LatestVersion()) + 1
	if err := drv.SetVersion(next, true); err != nil {
		t.Fatal(err)
	}
	// Past any cached readiness: each probe in these 2.5 s sees the migration in progress.
	for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		for _, base := range []string{ops, r.HTTPURL} {
			if code, body := get(t, base+"/readyz"); code != http.StatusOK {
				t.Fatalf("%s/readyz while a migration to %d runs: %d %q, want 200", base, next, code, body)
			}
		}
	}

	if err := drv.Unlock(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 10*time.Second, "/readyz to report the failed migration", func() bool {
		code, body := get(t, ops+"/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(body, "dirty") && strings.Contains(body, "force")
	})
	if code, body := get(t, r.HTTPURL+"/readyz"); code != http.StatusServiceUnavailable || strings.TrimSpace(body) != "schema not current" {
		t.Fatalf("public /readyz after the migration failed: %d %q", code, body)
	}
}

// A process started (without auto-migrate) while the migration it needs runs waits for it, then
// serves: it does not exit with advice about a failed migration.
func TestStartWaitsForAMigrationInProgress(t *testing.T) {
	url := testenv.FreshDB(t)
	latest := int(db.LatestVersion())
	drv := testenv.MigrationDriver(t, url)
	if err := drv.Lock(); err != nil {
		t.Fatal(err)
	}
	if err := drv.SetVersion(latest, true); err != nil { // file `latest` running: the schema is latest-1
		t.Fatal(err)
	}
	id := fmt.Sprintf("mig%d", time.Now().UnixNano()%1e9)
	pool := testenv.Pool(t, url)
	var released atomic.Bool
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done }) // before the driver closes
	go func() {
		defer close(done)
		// The process has its acceptance pool, so it is at the schema check; a process that
		// did not wait would be gone well within the second given to it.
		for n := 0; n == 0 && ctx.Err() == nil; time.Sleep(50 * time.Millisecond) {
			_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, "buzzpg-accept:"+id).Scan(&n)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
		released.Store(true)
		if err := drv.SetVersion(latest, false); err != nil {
			t.Error(err)
		}
		if err := drv.Unlock(); err != nil {
			t.Error(err)
		}
	}()
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, InstanceID: id, Env: map[string]string{"BUZZ_AUTO_MIGRATE": "false"}})
	if !released.Load() {
		t.Fatalf("the relay was ready before the migration finished:\n%s", r.Log())
	}
	if !strings.Contains(r.Log(), "waiting for a migration in progress") {
		t.Fatalf("the relay did not say it waited for the migration:\n%s", r.Log())
	}
}
