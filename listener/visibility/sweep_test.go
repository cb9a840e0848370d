package visibility

import (
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// claimTracer counts the publisher's claim statements (started, ended) on its pool.
type claimTracer struct {
	inFlight, ended atomic.Int32
}

type claimTracerKey struct{}

func (tr *claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "claim_visibility_work") {
		tr.inFlight.Add(1)
		return context.WithValue(ctx, claimTracerKey{}, true)
	}
	return ctx
}

func (tr *claimTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if ctx.Value(claimTracerKey{}) != nil {
		tr.inFlight.Add(-1)
		tr.ended.Add(1)
	}
}

// I2, a lost notification: the outbox NOTIFY trigger is off, so a change wakes nobody. The
// publisher has already run its start-up sweep and the drain after it (so neither can find the
// change), and nothing else of its own would claim again: only the periodic sweep (a short
// SweepInterval here) finds the pending viewer and publishes it.
func TestSnapshotPeriodicSweepFindsLostNotification(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.exec(`ALTER TABLE buzz.visibility_outbox DISABLE TRIGGER visibility_outbox_notify`)
	t.Cleanup(func() {
		_, _ = e.pool.Exec(context.Background(), `ALTER TABLE buzz.visibility_outbox ENABLE TRIGGER visibility_outbox_notify`)
	})

	tr := &claimTracer{}
	pool := tracedPool(t, e.url, 8, tr)
	const sweepEvery = 100 * time.Millisecond
	cfg := Config{
		InstanceID: "sweeper", RelaySecretKey: e.sk, SweepInterval: sweepEvery, Lease: 30 * time.Second,
		BackoffBase: 5 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		DatabaseURL: e.url, Logger: testenv.Logger(t, slog.LevelInfo, e.logs),
	}
	p := NewPublisher(cfg, pool)
	e.start(p)
	// The start-up sweep and the drain it kicked are over: from here on only a notification or
	// the periodic sweep makes a worker claim.
	testenv.WaitUntil(t, 10*time.Second, "start-up sweep and drain", func() bool {
		return p.counters().Sweeps >= 1 && tr.ended.Load() >= 1 && tr.inFlight.Load() == 0
	})

	// A session that LISTENs shows the change notifies nobody: a barrier notification on a
	// channel of its own (one the publisher does not hear), committed after the change, is the
	// first this session receives (notifications arrive in commit order).
	l := testenv.NewSession(t, e.url, "sweep-listen")
	if _, err := l.Conn.Exec(ctx, "LISTEN "+NotifyChannel+"; LISTEN sweep_test_barrier"); err != nil {
		t.Fatal(err)
	}
	viewer, x := e.hiddenViewer()
	if _, err := e.pool.Exec(ctx, `SELECT pg_notify('sweep_test_barrier', 'barrier')`); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if n, err := l.Conn.WaitForNotification(wctx); err != nil || n.Payload != "barrier" {
		t.Fatalf("setup: the change was announced (%+v, %v); the test needs it lost", n, err)
	}

	e.waitConverged([]string{viewer}, 20*time.Second)
	if _, hs := e.head(viewer); len(hs) != 1 || hs[0] != x {
		t.Fatalf("head says hidden %v, want [%s]", hs, x)
	}
	// The start-up sweep and at least one periodic one; no LISTEN reconnect (whose sweep would
	// have found the change too).
	if s := p.counters(); s.Sweeps < 2 || s.ListenConnects != 1 {
		t.Fatalf("stats %+v: want a periodic sweep and no LISTEN reconnect", s)
	}
	e.assertAuditMonotonic()
}
