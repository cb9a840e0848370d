package upkeep_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/upkeep"
)

func hex64() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// row is an event stored directly (no signature check: upkeep never reads one).
type row struct {
	kind    int
	pubkey  string
	created int64
	d       *string
	expires *int64
}

func insert(t *testing.T, pool *pgxpool.Pool, r row) string {
	t.Helper()
	id := hex64()
	if r.pubkey == "" {
		r.pubkey = hex64()
	}
	if _, err := pool.Exec(context.Background(), `INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, expires_at)
		VALUES ($1, $2, $3, $4, '[]'::jsonb, '', repeat('0', 128), $5, $6)`, id, r.pubkey, r.created, r.kind, r.d, r.expires); err != nil {
		t.Fatalf("insert kind %d: %v", r.kind, err)
	}
	return id
}

func stored(t *testing.T, pool *pgxpool.Pool, id string) bool {
	t.Helper()
	return testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.events WHERE id = $1`, id) == 1
}

func ptr[T any](v T) *T { return &v }

// setup gives a test its own database (rules there apply to every event in it), a pool and a
// runner with small batches, so a pass takes several transactions.
func setup(t *testing.T) (string, *pgxpool.Pool, *upkeep.Upkeep) {
	t.Helper()
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	return url, pool, runner(t, url, "a")
}

func runner(t *testing.T, url, name string) *upkeep.Upkeep {
	u := upkeep.New(upkeep.Config{DatabaseURL: url, InstanceID: name, Batch: 2,
		Grace: 5 * time.Minute, ReminderKeep: 7 * 24 * time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(u.Close)
	return u
}

func mustLead(t *testing.T, u *upkeep.Upkeep) {
	t.Helper()
	leader, err := u.RunOnce(context.Background())
	if err != nil || !leader {
		t.Fatalf("pass: leader=%v err=%v, want a pass that held the lock", leader, err)
	}
}

func rule(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("retention rule: %v", err)
	}
}
