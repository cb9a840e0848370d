package ops

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A server without wal_level=logical: serve refuses to start and says how to fix it. Runs on a
// private cluster of this test's own, restarted with wal_level=replica.
func TestStartupRefusesWalLevelNotLogical(t *testing.T) {
	c := testenv.PrivateCluster(t, "ops-wal-level")
	url := c.URL("")
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(context.Background(), `ALTER SYSTEM SET wal_level = 'replica'`)
	conn.Close(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Restart(); err != nil {
		t.Fatal(err)
	}
	key, _ := testenv.NewKey()
	out, code := runBinary(t, []string{"DATABASE_URL=" + url, "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=127.0.0.1:0"}, "serve")
	if code == 0 || !strings.Contains(out, "wal_level is replica") || !strings.Contains(out, "ALTER SYSTEM SET wal_level = logical") {
		t.Fatalf("exit %d, no clear wal_level error:\n%s", code, out)
	}
	t.Logf("serve said: %s", strings.TrimSpace(out[strings.LastIndex(strings.TrimSpace(out), "\n")+1:]))
	// Refused before anything was written: no migrations, no settings.
	conn, err = pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var schema *string
	if err := conn.QueryRow(context.Background(), `SELECT to_regnamespace('buzz')::text`).Scan(&schema); err != nil || schema != nil {
		t.Fatalf("serve migrated a server it then refused (schema %v, err %v)", schema, err)
	}
}

// A role without REPLICATION is refused at start, with what to do, before the process listens or
// writes the deployment's settings (buzz.config) that every process shares; before, the fan-out
// found out only once it streamed.
func TestStartupRefusesARoleWithoutReplication(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	role := fmt.Sprintf("norepl_%d", time.Now().UnixNano()%1e9)
	for _, q := range []string{
		`CREATE ROLE ` + role + ` LOGIN NOREPLICATION IN ROLE buzz_relay`,
		`UPDATE buzz.config SET value = '123' WHERE key = 'max_future_seconds'`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _, _ = pool.Exec(ctx, `DROP ROLE `+role) })
	key, _ := testenv.NewKey()
	out, code := runBinary(t, []string{"DATABASE_URL=" + testenv.AsRole(t, url, role), "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=127.0.0.1:0", "BUZZ_AUTO_MIGRATE=false"}, "serve")
	if code == 0 || !strings.Contains(out, "may not open replication connections") || !strings.Contains(out, "ALTER ROLE") || !strings.Contains(out, role) {
		t.Fatalf("exit %d, no clear REPLICATION error:\n%s", code, out)
	}
	if v := testenv.MustScalar[string](t, pool, `SELECT value FROM buzz.config WHERE key = 'max_future_seconds'`); v != "123" {
		t.Fatalf("the refused process wrote its settings: max_future_seconds = %s", v)
	}
}
