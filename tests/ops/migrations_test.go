package ops

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Every down migration runs, one step at a time, on a database holding rows (two tombstones for
// one id, by two deleters, which the schema allows); then up again reaches the latest version. A
// down file that no longer matches the schema it undoes fails here.
func TestMigrationsStepDownAndUpAgain(t *testing.T) {
	ctx := context.Background()
	url := testenv.EmptyDB(t)
	if out, code := runBinary(t, []string{"DATABASE_URL=" + url}, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %s", out)
	}
	pool := testenv.Pool(t, url)
	hex := func() string { _, pk := testenv.NewKey(); return pk }
	if _, err := pool.Exec(ctx, `INSERT INTO buzz.deleted_ids (id, pubkey, deleted_by) VALUES ($1, $2, $4), ($1, $3, $4)`,
		hex(), hex(), hex(), hex()); err != nil {
		t.Fatal(err)
	}
	pool.Close()

	m, err := db.NewMigrator(url, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for v := db.LatestVersion(); v > 0; v-- {
		if err := m.Steps(-1); err != nil {
			t.Fatalf("down from version %d: %v", v, err)
		}
		got, dirty, err := m.Version()
		if v > 1 && (err != nil || dirty || got != v-1) {
			t.Fatalf("after stepping down from %d: version %d dirty=%v err=%v", v, got, dirty, err)
		}
	}
	if out, code := runBinary(t, []string{"DATABASE_URL=" + url}, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up after down: %s", out)
	}
	v, dirty, current, err := db.SchemaStatus(url)
	if err != nil || dirty || !current {
		t.Fatalf("after down and up: version %d dirty=%v current=%v err=%v", v, dirty, current, err)
	}
}

// `migrate down` drops data, so it wants a count (or "all"); without one it changes nothing.
func TestMigrateDownNeedsACount(t *testing.T) {
	url := testenv.EmptyDB(t)
	env := []string{"DATABASE_URL=" + url}
	if out, code := runBinary(t, env, "migrate", "up"); code != 0 {
		t.Fatalf("migrate up: %s", out)
	}
	for _, args := range [][]string{{"migrate", "down"}, {"migrate", "down", "0"}, {"migrate", "down", "x"}} {
		out, code := runBinary(t, env, args...)
		if code == 0 || !strings.Contains(out, "down N") {
			t.Fatalf("%v: exit %d, want a usage error:\n%s", args, code, out)
		}
	}
	if v, _, current, err := db.SchemaStatus(url); err != nil || !current {
		t.Fatalf("after refused downs: version %d current=%v err=%v", v, current, err)
	}
	// N at or above the current version would run every down file, the last dropping schema buzz.
	if out, code := runBinary(t, env, "migrate", "down", strconv.Itoa(int(db.LatestVersion()))); code == 0 || !strings.Contains(out, "down all") {
		t.Fatalf("down %d: exit %d, want a refusal naming down all:\n%s", db.LatestVersion(), code, out)
	}
	if v, _, current, err := db.SchemaStatus(url); err != nil || !current {
		t.Fatalf("after a refused down %d: version %d current=%v err=%v", db.LatestVersion(), v, current, err)
	}
	if out, code := runBinary(t, env, "migrate", "down", "1"); code != 0 {
		t.Fatalf("migrate down 1: %s", out)
	}
	if v, _, _, err := db.SchemaStatus(url); err != nil || v != db.LatestVersion()-1 {
		t.Fatalf("after down 1: version %d err=%v, want %d", v, err, db.LatestVersion()-1)
	}
}
