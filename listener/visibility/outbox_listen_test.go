package visibility

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// listenOrderTracer is a pgx query tracer on the publisher's pool (and, with DatabaseURL empty,
// on its LISTEN connection, which copies the pool's config): it gives the test pause points
// inside the publisher without hooks in its code.
//
// Once armed:
//   - the 1st sweep (buzz.sweep_visibility) stops before its query until decoy is closed: it
//     keeps the Run goroutine busy, so a sweep kicked while it waits stays queued in p.sweepNow;
//   - the 2nd sweep (the reconnect's) stops after its query until sweep is closed: from then on
//     no drain follows a sweep, so only a notification can get new work published;
//   - a LISTEN that starts while a sweep is already queued (kicked before the LISTEN: the wrong
//     order) waits until work is closed, so that work commits between the sweep and the LISTEN.
type listenOrderTracer struct {
	p     *Publisher
	armed atomic.Bool

	sweeps         atomic.Int32 // sweep_visibility starts since arming
	claimsEnded    atomic.Int32 // claim queries finished (armed or not)
	claimsInFlight atomic.Int32

	decoyHeld, swept, listened, listenHeld chan struct{}
	decoy, sweep, work                     chan struct{}
	stop                                   chan struct{}
	once                                   sync.Map // name -> *sync.Once for the signal channels
}

type listenOrderKey struct{}

func newListenOrderTracer() *listenOrderTracer {
	return &listenOrderTracer{
		decoyHeld: make(chan struct{}), swept: make(chan struct{}), listened: make(chan struct{}),
		listenHeld: make(chan struct{}), decoy: make(chan struct{}), sweep: make(chan struct{}),
		work: make(chan struct{}), stop: make(chan struct{}),
	}
}

func (tr *listenOrderTracer) signal(name string, ch chan struct{}) {
	o, _ := tr.once.LoadOrStore(name, &sync.Once{})
	o.(*sync.Once).Do(func() { close(ch) })
}

func (tr *listenOrderTracer) hold(ctx context.Context, until chan struct{}) {
	select {
	case <-until:
	case <-tr.stop:
	case <-ctx.Done():
	}
}

func (tr *listenOrderTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "claim_visibility_work"):
		tr.claimsInFlight.Add(1)
		return context.WithValue(ctx, listenOrderKey{}, "claim")
	case !tr.armed.Load():
	case strings.Contains(d.SQL, "buzz.sweep_visibility()"):
		n := tr.sweeps.Add(1)
		if n == 1 {
			tr.signal("decoyHeld", tr.decoyHeld)
			tr.hold(ctx, tr.decoy)
		}
		if n == 2 {
			return context.WithValue(ctx, listenOrderKey{}, "sweep2")
		}
	case strings.HasPrefix(d.SQL, "LISTEN "):
		// The Run goroutine is held in the decoy sweep, so a sweep kicked before this LISTEN is
		// still queued: that is the wrong order, and the work commits before this LISTEN does.
		if len(tr.p.sweepNow) > 0 {
			tr.signal("listenHeld", tr.listenHeld)
			tr.hold(ctx, tr.work)
		}
		return context.WithValue(ctx, listenOrderKey{}, "listen")
	}
	return ctx
}

func (tr *listenOrderTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	switch ctx.Value(listenOrderKey{}) {
	case "claim":
		tr.claimsInFlight.Add(-1)
		tr.claimsEnded.Add(1)
	case "sweep2":
		tr.signal("swept", tr.swept)
		tr.hold(ctx, tr.sweep)
	case "listen":
		tr.signal("listened", tr.listened)
	}
}

func waitChan(t testing.TB, what string, chs ...chan struct{}) int {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		for i, ch := range chs {
			select {
			case <-ch:
				return i
			default:
			}
		}
		select {
		case <-timeout:
			t.Fatalf("timed out waiting for %s", what)
		case <-time.After(time.Millisecond):
		}
	}
}

// 4c. LISTEN before the (re)connect sweep: work committed after that sweep is announced by a
// notification, so it is published at once, not at the next periodic sweep (an hour away here).
// TestSnapshotListenConnectionKilled commits all its work while nobody listens, which the sweep
// finds whatever the order; here the work commits after the reconnect's sweep has run, with no
// drain after that sweep (held right after its query). With the sweep kicked before the LISTEN,
// the LISTEN is held until the work committed: its notification went to nobody, and the test
// fails.
func TestSnapshotListenBeforeReconnectSweep(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	tr := newListenOrderTracer()
	pool := tracedPool(t, e.url, 12, tr)
	cfg := Config{
		InstanceID: "order", RelaySecretKey: e.sk, SweepInterval: time.Hour, Lease: 30 * time.Second,
		BackoffBase: 5 * time.Millisecond, BackoffMax: 50 * time.Millisecond,
		DatabaseURL: "", // the LISTEN connection copies the pool's config, tracer included
		Logger:      testenv.Logger(t, slog.LevelInfo, e.logs),
	}
	p := NewPublisher(cfg, pool)
	tr.p = p
	e.start(p)
	t.Cleanup(func() { close(tr.stop) }) // runs before the publisher's stop (cleanups are LIFO)
	// The start-up sweep and the drain after it are over: no worker is busy, no wake-up queued.
	testenv.WaitUntil(t, 10*time.Second, "start-up sweep and drain", func() bool {
		return p.counters().Sweeps >= 1 && tr.claimsEnded.Load() >= 1 && tr.claimsInFlight.Load() == 0
	})

	// Lose the LISTEN connection and hold the reconnect.
	gate := pauseAt(t, HookListenReconnect, "")
	var killed int
	if err := e.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name = $1`, ListenAppName("order")).Scan(&killed); err != nil || killed != 1 {
		t.Fatalf("terminate LISTEN backend: %d %v", killed, err)
	}
	gate.Wait(t)

	// Occupy the Run goroutine with a decoy sweep, then let the reconnect go: it LISTENs and kicks
	// its sweep (in the right order), or kicks it and stops at the LISTEN (in the wrong order).
	tr.armed.Store(true)
	claimsBefore := tr.claimsEnded.Load()
	p.kickSweep()
	waitChan(t, "the decoy sweep", tr.decoyHeld)
	gate.Open()
	waitChan(t, "the reconnect's LISTEN", tr.listened, tr.listenHeld)

	// The decoy sweep finishes (its drain claims nothing), the reconnect's sweep runs and stops.
	close(tr.decoy)
	waitChan(t, "the reconnect sweep", tr.swept)
	testenv.WaitUntil(t, 10*time.Second, "the decoy sweep's drain", func() bool {
		return tr.claimsEnded.Load() > claimsBefore && tr.claimsInFlight.Load() == 0
	})

	// New work after the sweep; nothing but its notification can wake a worker now.
	viewer, _ := e.hiddenViewer()
	close(tr.work)
	deadline := time.Now().Add(10 * time.Second) // the next periodic sweep is an hour away
	for {
		if g := e.gens(viewer); g.published == g.target && g.target > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("work committed after the reconnect sweep was not published within 10s (generations %+v): "+
				"its NOTIFY reached nobody, so the sweep ran before the LISTEN", e.gens(viewer))
		}
		time.Sleep(5 * time.Millisecond)
	}
	e.assertConverged(viewer)
	close(tr.sweep)
}
