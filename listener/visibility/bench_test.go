package visibility

// Benchmarks of the NIP-DV publisher against real PostgreSQL. Run with cgo signing:
//
//	go test -tags libsecp256k1 ./listener/visibility -run '^$' -bench Snapshot -benchtime 1x -v
//
// Each reports its concurrency and a baseline measured in the same run on the same database.

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/fanout"
)

// dirtyViewers creates n viewers, each with one DM hidden (target 1, nothing published).
func dirtyViewers(b testing.TB, e *env, n int) []string {
	viewers := make([]string, n)
	for i := range viewers {
		_, viewers[i] = testenv.NewKey()
	}
	_, other := testenv.NewKey()
	for i := 0; i < n; i += 1000 {
		e.exec(`SELECT buzz.hide_dm(v, (buzz.open_dm(v, ARRAY[$2], NULL)).channel_id) FROM unnest($1::text[]) v`,
			viewers[i:min(i+1000, n)], other)
	}
	return viewers
}

func benchEnv(b *testing.B) *env {
	e := newEnv(b)
	e.exec(`DROP TRIGGER snapshot_audit ON buzz.events`) // measure the product, not the audit
	return e
}

func benchPool(b *testing.B, url string, conns int32) *pgxpool.Pool {
	p, err := db.NewPool(context.Background(), url, "buzzpg-bench", conns)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(p.Close)
	return p
}

// BenchmarkSnapshotRecovery: 10,000 dirty viewers at start → all published, by one publisher with
// W workers; baseline: the same number of single-row INSERT+COMMIT on W connections.
func BenchmarkSnapshotRecovery(b *testing.B) {
	const n = 10000
	for _, workers := range []int{4, 8} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				e := benchEnv(b)
				dirtyViewers(b, e, n)
				pool := benchPool(b, e.url, int32(workers+2))

				// Baseline: n single-row INSERT+COMMIT on `workers` connections.
				e.exec(`CREATE TABLE public.baseline (id bigint PRIMARY KEY, v text)`)
				var next atomic.Int64
				t0 := time.Now()
				var wg sync.WaitGroup
				for w := 0; w < workers; w++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for {
							id := next.Add(1)
							if id > n {
								return
							}
							if _, err := pool.Exec(context.Background(), `INSERT INTO public.baseline VALUES ($1, 'x')`, id); err != nil {
								b.Error(err)
								return
							}
						}
					}()
				}
				wg.Wait()
				base := time.Since(t0)

				p := NewPublisher(Config{InstanceID: "bench", RelaySecretKey: e.sk, Workers: workers,
					SweepInterval: time.Hour, DatabaseURL: e.url, Logger: testenv.Logger(b, slog.LevelInfo, e.logs)}, pool)
				b.ResetTimer()
				t0 = time.Now()
				e.start(p)
				testenv.WaitUntil(b, 5*time.Minute, "all published", func() bool { return p.counters().Published >= n })
				took := time.Since(t0)
				b.StopTimer()
				var left int
				_ = e.pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.visibility_state WHERE target_generation > published_generation`).Scan(&left)
				if left != 0 {
					b.Fatalf("%d viewers left pending", left)
				}
				b.ReportMetric(float64(n)/took.Seconds(), "snapshots/s")
				b.ReportMetric(float64(n)/base.Seconds(), "baseline_inserts/s")
				b.Logf("%d snapshots in %s = %.0f/s with %d workers; baseline %d INSERT+COMMIT on %d conns in %s = %.0f/s",
					n, took, float64(n)/took.Seconds(), workers, n, workers, base, float64(n)/base.Seconds())
			}
		})
	}
}

// change is one hide/unhide in flight for a viewer and when its effects were seen.
type change struct {
	hide                  bool
	committed, pub, fanAt time.Time
}

// BenchmarkSnapshotConvergence: hide/unhide changes committed at 500/s, each to a viewer with no
// other change in flight; latency from the change's COMMIT returning to (a) the snapshot's
// publication committed (publisher side) and (b) the snapshot delivered by the logical-replication
// fan-out (a live subscription's view). A snapshot seen before the driver got its COMMIT reply
// counts as 0.
func BenchmarkSnapshotConvergence(b *testing.B) {
	b.Run("notify", func(b *testing.B) { benchConvergence(b, false) })
	// Without the outbox NOTIFY trigger (PostgreSQL serialises the commits of notifying
	// transactions cluster-wide, which caps the change rate); the publisher polls every 5 ms.
	b.Run("poll5ms", func(b *testing.B) { benchConvergence(b, true) })
}

func benchConvergence(b *testing.B, poll bool) {
	rate := benchRate()
	const changes = 5000
	const nViewers = 2000
	e := benchEnv(b)
	viewers := dirtyViewers(b, e, nViewers)
	var chans []string
	if err := e.pool.QueryRow(context.Background(), `SELECT array_agg(m.channel_id::text ORDER BY v.o)
		FROM unnest($1::text[]) WITH ORDINALITY v(pk, o) JOIN buzz.members m ON m.pubkey = v.pk`, viewers).Scan(&chans); err != nil {
		b.Fatal(err)
	}
	pool := benchPool(b, e.url, 8)
	cfg := Config{InstanceID: "bench", RelaySecretKey: e.sk, SweepInterval: time.Hour,
		DatabaseURL: e.url, Logger: testenv.Logger(b, slog.LevelInfo, e.logs)}
	if poll {
		e.exec(`ALTER TABLE buzz.visibility_outbox DISABLE TRIGGER visibility_outbox_notify`)
		cfg.PollInterval = 5 * time.Millisecond
	}
	p := NewPublisher(cfg, pool)
	var mu sync.Mutex
	inflight := map[string]*change{}
	var all []*change
	p.onPublished = func(viewer string) {
		at := time.Now()
		mu.Lock()
		if c := inflight[viewer]; c != nil && c.pub.IsZero() {
			c.pub = at
		}
		mu.Unlock()
	}
	e.start(p)
	testenv.WaitUntil(b, 2*time.Minute, "initial backlog published", func() bool { return p.counters().Published >= nViewers })

	// The sink sees every snapshot reaching this process through the fan-out (what a live
	// subscription of the viewer would receive).
	sink := testenv.Sink{Event: func(d evt.Delivery) {
		if d.Event.Kind != KindVisibilitySnapshot {
			return
		}
		viewer, hidden, at := d.Scope.P, d.Event.Tags.GetFirst([]string{"h"}) != nil, time.Now()
		mu.Lock()
		if c := inflight[viewer]; c != nil && c.fanAt.IsZero() && c.hide == hidden {
			c.fanAt = at
		}
		mu.Unlock()
	}}
	fan := fanout.New(fanout.Config{DatabaseURL: e.url, InstanceID: fmt.Sprintf("bench_%d", time.Now().UnixNano()%1e9),
		Logger: testenv.Logger(b, slog.LevelInfo, &testenv.LogBuf{})}, e.pool, sink)
	fctx, fcancel := context.WithCancel(context.Background())
	go fan.Run(fctx)
	b.Cleanup(func() {
		fcancel()
		cctx, cc := context.WithTimeout(context.Background(), 10*time.Second)
		defer cc()
		_ = fan.Close(cctx)
	})
	testenv.WaitUntil(b, 30*time.Second, "fan-out attached", fan.Ready)

	// Driver: paced at `rate` changes/s in total, open loop (up to 64 in flight on 16 connections);
	// viewers in turn (each changes every nViewers/rate seconds): unhide, and hide again next round.
	drv := benchPool(b, e.url, 16)
	b.ResetTimer()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	t0 := time.Now()
	for i := 0; i < changes; i++ {
		<-tick.C
		v, ch := viewers[i%nViewers], chans[i%nViewers]
		c := &change{hide: (i/nViewers)%2 == 1}
		mu.Lock()
		inflight[v] = c
		all = append(all, c)
		mu.Unlock()
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			q := `SELECT buzz.unhide_dm($1, $2::uuid)`
			if c.hide {
				q = `SELECT buzz.hide_dm($1, $2::uuid)`
			}
			if _, err := drv.Exec(context.Background(), q, v, ch); err != nil {
				b.Error(err)
				return
			}
			at := time.Now()
			mu.Lock()
			c.committed = at
			mu.Unlock()
		}()
	}
	wg.Wait()
	offered := float64(changes) / time.Since(t0).Seconds()
	testenv.WaitUntil(b, time.Minute, "all deliveries", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range all {
			if c.fanAt.IsZero() || c.pub.IsZero() {
				return false
			}
		}
		return true
	})
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	var pubLat, fanLat []time.Duration
	for _, c := range all {
		pubLat = append(pubLat, max(0, c.pub.Sub(c.committed)))
		fanLat = append(fanLat, max(0, c.fanAt.Sub(c.committed)))
	}
	pq := quantiles(pubLat)
	fq := quantiles(fanLat)
	b.ReportMetric(offered, "changes/s")
	b.ReportMetric(float64(pq[0].Microseconds())/1000, "commit_p50_ms")
	b.ReportMetric(float64(pq[1].Microseconds())/1000, "commit_p99_ms")
	b.ReportMetric(float64(fq[0].Microseconds())/1000, "fanout_p50_ms")
	b.ReportMetric(float64(fq[1].Microseconds())/1000, "fanout_p99_ms")
	b.Logf("%d changes at %.0f/s over %d viewers, %d workers; change commit -> snapshot committed: p50 %s p99 %s max %s; -> fan-out delivery: p50 %s p99 %s max %s",
		changes, offered, nViewers, p.cfg.Workers, pq[0], pq[1], pq[2], fq[0], fq[1], fq[2])
}

func quantiles(d []time.Duration) [3]time.Duration {
	if len(d) == 0 {
		return [3]time.Duration{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return [3]time.Duration{s[len(s)/2], s[len(s)*99/100], s[len(s)-1]}
}

// benchRate is the offered change rate (BUZZ_BENCH_RATE, default 500/s).
func benchRate() int {
	return testenv.EnvInt("BUZZ_BENCH_RATE", 500)
}
