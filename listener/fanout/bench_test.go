package fanout

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkFanoutLatency: accept→delivery latency through the replication tail at a fixed rate,
// beside the in-process baseline measured in the same run (the writer "delivers" itself the moment
// accept_event's commit returns, as the accepting relay process can). Writers: BUZZ_BENCH_WRITERS
// connections (default 8) sharing a paced schedule of BUZZ_BENCH_RATE events/s (default 1000) for
// BUZZ_BENCH_DURATION (default 3s). Events are signed before the clock starts: signature checking
// belongs to the relay, not to fan-out.
//
//	go test ./listener/fanout -run '^$' -bench FanoutLatency -benchtime 1x
//	BUZZ_BENCH_DURATION=30s go test ./listener/fanout -run '^$' -bench FanoutLatency -benchtime 1x
func BenchmarkFanoutLatency(b *testing.B) {
	rate := testenv.EnvInt("BUZZ_BENCH_RATE", 1000)
	writers := testenv.EnvInt("BUZZ_BENCH_WRITERS", 8)
	dur := 3 * time.Second
	if s := os.Getenv("BUZZ_BENCH_DURATION"); s != "" {
		dur, _ = time.ParseDuration(s)
	}
	h := newHarness(b)
	n := int(float64(rate) * dur.Seconds())
	bodies := make([]string, n)
	ids := make([]string, n)
	for i := range bodies {
		ev := signedEvent(1, "bench", nil)
		bb, _ := ev.MarshalJSON()
		bodies[i], ids[i] = string(bb), ev.ID
	}
	index := make(map[string]int, n)
	for i, id := range ids {
		index[id] = i
	}
	sent := make([]time.Time, n)
	inproc := make([]time.Duration, n)
	viaRepl := make([]time.Duration, n)
	var mu sync.Mutex
	got := 0
	all := make(chan struct{})
	sink := testenv.Sink{Event: func(d evt.Delivery) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		if i, ok := index[d.Event.ID]; ok && viaRepl[i] == 0 {
			viaRepl[i] = now.Sub(sent[i])
			if got++; got == n {
				close(all)
			}
		}
	}}
	h.start(Config{}, sink, nil)
	b.ResetTimer()

	ctx := context.Background()
	interval := time.Second / time.Duration(rate)
	start := time.Now().Add(50 * time.Millisecond)
	next := make(chan int, writers)
	go func() {
		for i := 0; i < n; i++ {
			time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
			next <- i
		}
		close(next)
	}()
	var wg sync.WaitGroup
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				mu.Lock()
				sent[i] = time.Now()
				mu.Unlock()
				if _, err := h.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, bodies[i]); err != nil {
					b.Error(err)
					return
				}
				mu.Lock()
				inproc[i] = time.Since(sent[i])
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	achieved := float64(n) / time.Since(start).Seconds()
	select {
	case <-all:
	case <-time.After(30 * time.Second):
		b.Fatalf("only %d of %d events delivered", got, n)
	}
	b.StopTimer()
	added := make([]time.Duration, n)
	for i := range added {
		added[i] = viaRepl[i] - inproc[i]
	}
	ip, rp, ap := testenv.Percentiles(inproc), testenv.Percentiles(viaRepl), testenv.Percentiles(added)
	b.Logf("%d events at %.0f/s offered %d/s, %d writer connections", n, achieved, rate, writers)
	b.Logf("in-process (commit returned): p50 %s p99 %s max %s", ip[0], ip[1], ip[2])
	b.Logf("via replication tail:         p50 %s p99 %s max %s", rp[0], rp[1], rp[2])
	b.Logf("added by replication per event: p50 %s p99 %s max %s", ap[0], ap[1], ap[2])
	b.ReportMetric(float64(ap[1].Microseconds())/1000, "added-p99-ms")
	b.ReportMetric(float64(rp[0].Microseconds())/1000, "repl-p50-ms")
	b.ReportMetric(float64(rp[1].Microseconds())/1000, "repl-p99-ms")
	b.ReportMetric(float64(rp[2].Microseconds())/1000, "repl-max-ms")
	b.ReportMetric(float64(ip[0].Microseconds())/1000, "inproc-p50-ms")
	b.ReportMetric(float64(ip[1].Microseconds())/1000, "inproc-p99-ms")
	b.ReportMetric(float64(ip[2].Microseconds())/1000, "inproc-max-ms")
}
