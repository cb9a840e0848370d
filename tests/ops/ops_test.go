// Package ops tests what an operator meets: startup, migrations, health, metrics, shutdown.
package ops

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Five serve processes starting together on an empty database end with one applied schema.
func TestConcurrentStartsApplyOneSchema(t *testing.T) {
	url := testenv.EmptyDB(t)
	key, _ := testenv.NewKey()
	opts := make([]testenv.RelayOpts, 5)
	for i := range opts {
		opts[i] = testenv.RelayOpts{DatabaseURL: url, RelayKey: key}
	}
	// Started together; StartRelays fails the test (from this goroutine) if any did not start.
	testenv.StartRelays(t, opts...)
	pool := testenv.Pool(t, url)
	// golang-migrate keeps a single row (it truncates before each insert), so only its version
	// and dirty flag say anything.
	var version int
	var dirty bool
	if err := pool.QueryRow(context.Background(),
		`SELECT version, dirty FROM `+db.MigrationsTable).Scan(&version, &dirty); err != nil {
		t.Fatal(err)
	}
	if uint(version) != db.LatestVersion() || dirty {
		t.Fatalf("migrations table: version %d (want %d), dirty %v", version, db.LatestVersion(), dirty)
	}
	if fns := testenv.MustInt(t, pool,
		`SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname='buzz' AND p.proname='accept_event'`); fns != 1 {
		t.Fatalf("accept_event defined %d times", fns)
	}
}

func runBinary(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(testenv.Binary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd = exec.CommandContext(ctx, cmd.Path, args...)
	cmd.Env = append(os.Environ(), env...)
	out, _ := cmd.CombinedOutput()
	return string(out), cmd.ProcessState.ExitCode()
}

func TestStartupErrorsSayWhatToDo(t *testing.T) {
	key, _ := testenv.NewKey()
	good := testenv.DB(t)
	type startupCase struct {
		name string
		env  []string
		want string
	}
	cases := []startupCase{
		{"no database url", []string{"DATABASE_URL=", "BUZZ_RELAY_KEY=" + key}, "DATABASE_URL is not set"},
		{"bad key", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=xyz"}, "must be 64 hex"},
		{"no key", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=", "BUZZ_RELAY_KEY_FILE="}, "buzzpg keygen"},
		{"missing key file", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=", "BUZZ_RELAY_KEY_FILE=/nonexistent/relay.key"}, "cannot read BUZZ_RELAY_KEY_FILE"},
		{"unreachable database", []string{"DATABASE_URL=postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=2", "BUZZ_RELAY_KEY=" + key, "BUZZ_AUTO_MIGRATE=false"}, "cannot reach PostgreSQL"},
	}
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	cases = append(cases,
		startupCase{"port in use", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=" + busy.Addr().String()}, "set BUZZ_LISTEN to a free address"},
		startupCase{"wildcard listen without a relay URL", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=0.0.0.0:0", "BUZZ_RELAY_URL="}, "set BUZZ_RELAY_URL to the URL clients use"},
		startupCase{"zero duration", []string{"DATABASE_URL=" + good, "BUZZ_RELAY_KEY=" + key, "BUZZ_REMINDER_HORIZON=0s"}, "BUZZ_REMINDER_HORIZON=0s must be at least"},
	)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out, code := runBinary(t, append([]string{"BUZZ_LISTEN=127.0.0.1:0"}, c.env...), "serve")
			if code == 0 || !strings.Contains(out, c.want) {
				t.Fatalf("exit %d, output does not say %q:\n%s", code, c.want, out)
			}
		})
	}
}

func TestStartupRefusesDirtyOrMissingSchema(t *testing.T) {
	key, _ := testenv.NewKey()
	empty := testenv.EmptyDB(t)
	out, code := runBinary(t, []string{"DATABASE_URL=" + empty, "BUZZ_RELAY_KEY=" + key, "BUZZ_AUTO_MIGRATE=false", "BUZZ_LISTEN=127.0.0.1:0"}, "serve")
	if code == 0 || !strings.Contains(out, "migrate up") {
		t.Fatalf("missing schema: exit %d:\n%s", code, out)
	}
	if out, code := runBinary(t, []string{"DATABASE_URL=" + empty}, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %s", out)
	}
	pool := testenv.Pool(t, empty)
	if _, err := pool.Exec(context.Background(), `UPDATE `+db.MigrationsTable+` SET dirty = true`); err != nil {
		t.Fatal(err)
	}
	out, code = runBinary(t, []string{"DATABASE_URL=" + empty, "BUZZ_RELAY_KEY=" + key, "BUZZ_LISTEN=127.0.0.1:0"}, "serve")
	if code == 0 || !strings.Contains(out, "dirty") || !strings.Contains(out, "force") {
		t.Fatalf("dirty schema: exit %d:\n%s", code, out)
	}
}

// An old binary during a rollout or a rollback finds the schema a newer one migrated. `serve`
// with auto-migrate (the default) serves it, as with auto-migrate off, instead of exiting on
// golang-migrate's "no migration found for version N" and crash-looping; `migrate up` says what
// happened. The newer schema is faked by raising the recorded version.
func TestOldBinaryServesANewerSchema(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	newer := db.LatestVersion() + 1
	if _, err := pool.Exec(context.Background(), `UPDATE `+db.MigrationsTable+` SET version = $1`, newer); err != nil {
		t.Fatal(err)
	}
	out, code := runBinary(t, []string{"DATABASE_URL=" + url}, "migrate", "up")
	if code == 0 || !strings.Contains(out, "newer than this binary") {
		t.Fatalf("migrate up on a newer schema: exit %d:\n%s", code, out)
	}
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url})
	if code, body := get(t, r.HTTPURL+"/readyz"); code != 200 {
		t.Fatalf("/readyz on a newer schema: %d %s", code, body)
	}
	c := r.Connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Publish(ctx, *testenv.NewUser().Event(t, 1, nil, "served by an older binary")); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if v := testenv.MustInt(t, pool, `SELECT version FROM `+db.MigrationsTable); uint(v) != newer {
		t.Fatalf("schema version %d after serve, want %d untouched", v, newer)
	}
}

func TestKeygen(t *testing.T) {
	out, code := runBinary(t, nil, "keygen")
	if code != 0 || !regexp.MustCompile(`^[0-9a-f]{64}\n$`).MatchString(out) {
		t.Fatalf("keygen: %d %q", code, out)
	}
	file := filepath.Join(t.TempDir(), "relay.key")
	if _, code := runBinary(t, nil, "keygen", "--out", file); code != 0 {
		t.Fatal("keygen --out failed")
	}
	st, err := os.Stat(file)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", st, err)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Metrics are served on BUZZ_METRICS_LISTEN only: on the public listener, counters that move
// when a message resurfaces a DM would tell a member that another had hidden it.
func TestHealthReadyAndMetrics(t *testing.T) {
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	opsAddr := free.Addr().String()
	free.Close()
	url := testenv.FreshDB(t)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, Env: map[string]string{"BUZZ_METRICS_LISTEN": opsAddr}})
	ops := "http://" + opsAddr
	for _, base := range []string{r.HTTPURL, ops} {
		if code, body := get(t, base+"/readyz"); code != 200 {
			t.Fatalf("%s/readyz %d %s", base, code, body)
		}
	}
	if code, _ := get(t, r.HTTPURL+"/healthz"); code != 200 {
		t.Fatalf("/healthz %d", code)
	}
	if code, body := get(t, r.HTTPURL+"/metrics"); code != http.StatusNotFound {
		t.Fatalf("public /metrics: %d, want 404:\n%.200s", code, body)
	}
	// Publish one event so the counters move, then scrape.
	c := r.Connect(t)
	u := testenv.NewUser()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Publish(ctx, *u.Event(t, 1, nil, "metrics")); err != nil {
		t.Fatal(err)
	}
	// The relay hears its own event back through the replication stream; wait for that count.
	fanned := regexp.MustCompile(`(?m)^buzz_fanout_events_total\{source="insert"\} [1-9]`)
	var code int
	var body string
	testenv.WaitUntil(t, 10*time.Second, "fan-out counter", func() bool {
		code, body = get(t, ops+"/metrics")
		return code == 200 && fanned.MatchString(body)
	})
	// Sample lines (not HELP/TYPE comments) that must be present.
	for _, want := range []string{
		`(?m)^buzz_events_total\{verdict="accepted"\} [1-9]`,
		`(?m)^buzz_connections [0-9]`,
		`(?m)^buzz_subscriptions [0-9]`,
		`(?m)^buzz_fanout_attached 1$`,
		`(?m)^buzz_fanout_lag_seconds [0-9]`,
		`(?m)^buzz_visibility_pending_viewers [0-9]`,
		`(?m)^buzz_snapshot_publications_total\{outcome="published"\} [0-9]`,
		`(?m)^buzz_reminder_claims_total\{outcome="confirmed"\} [0-9]`,
		`(?m)^buzz_accept_seconds_bucket\{le="[^"]+"\} [1-9]`,
	} {
		if !regexp.MustCompile(want).MatchString(body) {
			t.Errorf("/metrics has no sample matching %s", want)
		}
	}

	// Not ready: the public /readyz names what is wrong, the private one also why.
	pool := testenv.Pool(t, url)
	if _, err := pool.Exec(context.Background(), `UPDATE `+db.MigrationsTable+` SET dirty = true`); err != nil {
		t.Fatal(err)
	}
	// Readiness is checked at most once a second: the next check sees the dirty schema.
	var pubCode int
	var pubBody string
	testenv.WaitUntil(t, 5*time.Second, "the public /readyz to see the dirty schema", func() bool {
		pubCode, pubBody = get(t, r.HTTPURL+"/readyz")
		return pubCode != http.StatusOK
	})
	if pubCode != http.StatusServiceUnavailable || strings.TrimSpace(pubBody) != "schema not current" {
		t.Errorf("public /readyz of a dirty schema: %d %q, want 503 \"schema not current\" alone", pubCode, pubBody)
	}
	if code, body := get(t, ops+"/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "schema not current: schema:") {
		t.Errorf("private /readyz of a dirty schema: %d %q, want 503 with the reason", code, body)
	}
}

// SIGTERM: the process stops, drops its replication slot and its instance row.
func TestGracefulShutdownDropsSlot(t *testing.T) {
	url := testenv.DB(t)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url})
	pool := testenv.Pool(t, url)
	slots := func() int {
		t.Helper()
		return testenv.MustInt(t, pool, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'buzz_' || $1`, r.InstanceID)
	}
	if slots() != 1 {
		t.Fatal("no slot while running")
	}
	r.Stop()
	if code := r.ExitCode(); code != 0 {
		t.Fatalf("exit code %d after SIGTERM", code)
	}
	if slots() != 0 {
		t.Fatal("slot survived a graceful shutdown")
	}
	if testenv.MustInt(t, pool, `SELECT count(*) FROM buzz.instances WHERE instance_id=$1`, r.InstanceID) != 0 {
		t.Fatal("instance row survived a graceful shutdown")
	}
}

// The relay opens and warms BUZZ_ACCEPT_CONNS_MIN acceptance connections before it reports
// ready: each has run accept_events and accept_event (two rows inserted per connection: the
// batched path and its fallback) in a transaction that was rolled back (none is stored, none
// reached a subscriber).
func TestAcceptConnectionsWarmedBeforeServing(t *testing.T) {
	url := testenv.FreshDB(t) // its own statistics: nothing else inserts here
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, Env: map[string]string{"BUZZ_ACCEPT_CONNS_MIN": "4"}})
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	var conns int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`,
		"buzzpg-accept:"+r.InstanceID).Scan(&conns); err != nil {
		t.Fatal(err)
	}
	if conns < 4 {
		t.Fatalf("%d acceptance connections open when the relay reported ready, want at least 4", conns)
	}
	// Backends report their table counters when idle (PostgreSQL 15: within about 10 s).
	var inserted, live, stored int64
	testenv.WaitUntil(t, 20*time.Second, "two warm-up inserts per connection in the statistics", func() bool {
		if err := pool.QueryRow(ctx, `SELECT n_tup_ins, n_live_tup FROM pg_stat_user_tables
		                               WHERE schemaname = 'buzz' AND relname = 'events'`).Scan(&inserted, &live); err != nil {
			t.Fatal(err)
		}
		return inserted >= 8
	})
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM buzz.events`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	if stored != 0 || live != 0 {
		t.Fatalf("the warm-up stored events: %d rows, %d live tuples", stored, live)
	}
}

// buzz.config is shared: a process that starts with another relay key (a rotation, or a
// misconfigured replica) replaces it for everyone, and says so.
func TestSharedSettingReplacementIsLogged(t *testing.T) {
	dbURL := testenv.FreshDB(t) // the package database has seen other processes' settings
	first := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	if strings.Contains(first.Log(), "replaces a shared setting") {
		t.Fatalf("the first process warned:\n%s", first.Log())
	}
	second := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: first.Opts.RelayKey})
	if strings.Contains(second.Log(), "replaces a shared setting") {
		t.Fatalf("a process with the same settings warned:\n%s", second.Log())
	}
	other := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	if !regexp.MustCompile(`replaces a shared setting[^\n]*relay_pubkey`).MatchString(other.Log()) {
		t.Fatalf("a process with another relay key did not say it replaced relay_pubkey:\n%s", other.Log())
	}
	// A deployment from before settings_written_by existed has a key but no recorded writer.
	pool := testenv.Pool(t, dbURL)
	if _, err := pool.Exec(context.Background(), `DELETE FROM buzz.config WHERE key = 'settings_written_by'`); err != nil {
		t.Fatal(err)
	}
	upgraded := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	if !regexp.MustCompile(`replaces a shared setting[^\n]*relay_pubkey`).MatchString(upgraded.Log()) {
		t.Fatalf("after an upgrade, a process with another relay key did not say it replaced relay_pubkey:\n%s", upgraded.Log())
	}
}

// remindNowAndWaitConfirmed publishes, as u over c, a reminder due now, and waits until a
// scheduler has claimed and confirmed it (admin reads its row).
func remindNowAndWaitConfirmed(t *testing.T, c *testenv.Client, u testenv.User, admin *pgxpool.Pool) {
	t.Helper()
	rem := u.Event(t, 30300, nostr.Tags{{"d", "standup"}, {"not_before", fmt.Sprint(time.Now().Unix())}}, "enc")
	c.MustPublish(rem)
	testenv.WaitUntil(t, 20*time.Second, "the reminder confirmed", func() bool {
		var state string
		_ = admin.QueryRow(context.Background(), `SELECT state FROM buzz.reminders WHERE id = $1`, rem.ID).Scan(&state)
		return state == "confirmed"
	})
}
