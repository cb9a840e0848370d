package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkFanoutCrossProcess measures publish→delivery latency from a writer on process A to a
// subscriber on process B at a fixed offered rate, and in the same run:
//   - "ok": publish→OK on A, i.e. the moment A's commit returned. That is when an in-process
//     delivery (sink in the writer's own process) could happen at the earliest: the baseline.
//   - "same": publish→delivery to a subscriber on A itself (A delivers its own events through its
//     own replication tail too).
//   - "cross": publish→delivery to a subscriber on B. Target: p99 ≤ 10 ms at 1,000 events/s.
//   - "cross-ok": per event, cross minus ok: what fan-out adds to in-process delivery.
//   - "sql": before the relay load, the same number of events at the same rate and concurrency
//     go straight into buzz.accept_event from Go (no WebSocket, no relay in the path; the two
//     relays are attached and tail them). Its latency is the floor this machine's PostgreSQL
//     sets for "ok", and so for "cross".
//
// Concurrency: BUZZ_BENCH_WRITERS WebSocket connections on A (default 8) share one paced schedule;
// events are signed before the clock starts. Rates: BUZZ_BENCH_RATES (default "1000"; e.g.
// "250,500,1000,2000" to find where delivery stops keeping up: everything delivered and p99 ≤ 1 s), each for BUZZ_BENCH_DURATION
// (default 3s; the figure is 30s). BUZZ_BENCH_TRACE=prefix writes every event's latencies
// to prefix.<rate>.csv. BUZZ_BENCH_RELAY_ENV="K=V ..." sets environment variables of both relay
// processes (e.g. GOMAXPROCS=1).
//
//	go test ./tests -run '^$' -bench FanoutCrossProcess -benchtime 1x
//	BUZZ_BENCH_DURATION=30s BUZZ_BENCH_RATES=1000,2000,3000 go test ./tests -run '^$' -bench FanoutCrossProcess -benchtime 1x -timeout 30m
func BenchmarkFanoutCrossProcess(b *testing.B) {
	dur := 3 * time.Second
	if s := os.Getenv("BUZZ_BENCH_DURATION"); s != "" {
		dur, _ = time.ParseDuration(s)
	}
	writers := testenv.EnvInt("BUZZ_BENCH_WRITERS", 8)
	rates := []int{1000}
	if s := os.Getenv("BUZZ_BENCH_RATES"); s != "" {
		rates = nil
		for _, f := range strings.Split(s, ",") {
			if v, err := strconv.Atoi(strings.TrimSpace(f)); err == nil && v > 0 {
				rates = append(rates, v)
			}
		}
	}
	dbURL := testenv.FreshDB(b)
	key, _ := testenv.NewKey()
	env := map[string]string{}
	for _, kv := range strings.Fields(os.Getenv("BUZZ_BENCH_RELAY_ENV")) {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	a := testenv.StartRelay(b, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: key, Env: env})
	bb := testenv.StartRelay(b, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: key, Env: env})
	// Reported after the last rate: runFanoutLoad calls b.ResetTimer, which drops metrics
	// reported before it, so reporting per rate kept only the last rate's.
	metrics := map[string]float64{}
	best := 0
	for _, rate := range rates {
		floor := runSQLFloor(b, dbURL, rate, dur, writers)
		r := runFanoutLoad(b, a, bb, rate, dur, writers)
		r.pct["sql"], r.got["sql"] = floor, int(float64(rate)*dur.Seconds())
		b.Logf("rate %d/s offered, %.0f/s sent, %d events, %d writer connections on A:", rate, r.sentRate, r.n, writers)
		for _, k := range []string{"sql", "ok", "same", "cross", "cross-ok"} {
			p := r.pct[k]
			b.Logf("  %-8s p50 %8s  p99 %8s  max %8s  (%d/%d)", k, p[0].Round(10*time.Microsecond), p[1].Round(10*time.Microsecond), p[2].Round(10*time.Microsecond), r.got[k], r.n)
		}
		// The load tool's rule (internal/bench/fanout.go): everything delivered and p99 within 1 s.
		// "All delivered" alone is not keeping up: at 2,000/s for 8 s every event arrived, 5 s late.
		keptUp := r.got["cross"] == r.n && r.pct["cross"][1] <= time.Second
		if keptUp && rate > best {
			best = rate
		}
		b.Logf("  keeps up: %v (all %d delivered: %v, cross p99 ≤ 1 s); target cross-process p99 ≤ 10 ms: %v",
			keptUp, r.n, r.got["cross"] == r.n, r.pct["cross"][1] <= 10*time.Millisecond)
		metrics[fmt.Sprintf("cross-p50-ms@%d", rate)] = ms(r.pct["cross"][0])
		metrics[fmt.Sprintf("cross-p99-ms@%d", rate)] = ms(r.pct["cross"][1])
		metrics[fmt.Sprintf("cross-max-ms@%d", rate)] = ms(r.pct["cross"][2])
		metrics[fmt.Sprintf("ok-p99-ms@%d", rate)] = ms(r.pct["ok"][1])
		metrics[fmt.Sprintf("sql-p99-ms@%d", rate)] = ms(r.pct["sql"][1])
	}
	b.Logf("highest rate kept up: %d/s", best)
	for k, v := range metrics {
		b.ReportMetric(v, k)
	}
	b.ReportMetric(float64(best), "kept-up-max/s")
}

// writeFanoutTrace writes one line per event (send offset from the start, then the ok, same and
// cross latencies in microseconds; -1 when never seen), to find when in a run the tail happens.
func writeFanoutTrace(b *testing.B, path string, start time.Time, sent []time.Time, lat map[string][]time.Duration) {
	var sb strings.Builder
	sb.WriteString("sent_us,ok_us,same_us,cross_us\n")
	us := func(d time.Duration) int64 {
		if d == 0 {
			return -1
		}
		return d.Microseconds()
	}
	for i, t := range sent {
		fmt.Fprintf(&sb, "%d,%d,%d,%d\n", t.Sub(start).Microseconds(), us(lat["ok"][i]), us(lat["same"][i]), us(lat["cross"][i]))
	}
	if err := os.WriteFile(path, []byte(sb.String()), 0o644); err != nil {
		b.Errorf("trace: %v", err)
	}
}

// runSQLFloor calls buzz.accept_event directly, paced like runFanoutLoad (event i at
// start + i/rate, spread over conns connections, each call timed from its scheduled send), and
// returns p50/p99/max. The pool is warmed like a relay's.
func runSQLFloor(b *testing.B, dbURL string, rate int, dur time.Duration, conns int) [3]time.Duration {
	ctx := context.Background()
	pool, err := db.NewPool(ctx, dbURL, "bench-sql-floor", int32(conns), store.WarmAccept(int32(conns)))
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	if err := store.Warm(ctx, pool, conns); err != nil {
		b.Fatal(err)
	}
	author := newFanUser()
	n := int(float64(rate) * dur.Seconds())
	raws := make([][]byte, n)
	for i := range raws {
		raws[i], _ = json.Marshal(author.event(1, "floor"))
	}
	lat := make([]time.Duration, n)
	interval := time.Second / time.Duration(rate)
	start := time.Now().Add(20 * time.Millisecond)
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := 0; w < conns; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += conns {
				at := start.Add(time.Duration(i) * interval)
				time.Sleep(time.Until(at))
				if ok, _, err := store.AcceptJSON(ctx, pool, raws[i]); err != nil || !ok {
					failed.Add(1)
				}
				lat[i] = time.Since(at)
			}
		}()
	}
	wg.Wait()
	if f := failed.Load(); f > 0 {
		b.Fatalf("sql floor: %d of %d calls failed", f, n)
	}
	return pct3(lat)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

type loadResult struct {
	n        int
	sentRate float64
	got      map[string]int
	pct      map[string][3]time.Duration
}

func runFanoutLoad(b *testing.B, a, bb *testenv.Relay, rate int, dur time.Duration, writers int) loadResult {
	author := newFanUser()
	n := int(float64(rate) * dur.Seconds())
	evs := make([]*nostr.Event, n)
	index := make(map[string]int, n)
	for i := range evs {
		evs[i] = author.event(1, "bench")
		index[evs[i].ID] = i
	}
	var mu sync.Mutex
	sent := make([]time.Time, n)
	lat := map[string][]time.Duration{"ok": make([]time.Duration, n), "same": make([]time.Duration, n), "cross": make([]time.Duration, n)}
	got := map[string]int{}
	record := func(kind string, id string, at time.Time) {
		mu.Lock()
		defer mu.Unlock()
		if i, ok := index[id]; ok && !sent[i].IsZero() && lat[kind][i] == 0 {
			lat[kind][i] = at.Sub(sent[i])
			got[kind]++
		}
	}
	subscribe := func(r *testenv.Relay, kind string) {
		onEvent := testenv.OnEvent(func(_ string, ev *nostr.Event, at time.Time) { record(kind, ev.ID, at) })
		testenv.Dial(b, r.URL, onEvent).Subscribe(nostr.Filter{Authors: []string{author.pk}})
	}
	subscribe(a, "same")
	subscribe(bb, "cross")
	onOK := testenv.OnOK(func(id string, ok bool, msg string, at time.Time) {
		if !ok {
			b.Errorf("publish refused: %s", msg)
		}
		record("ok", id, at)
	})
	pubs := make([]*testenv.Client, writers)
	for i := range pubs {
		pubs[i] = testenv.Dial(b, a.URL, onOK)
	}
	b.ResetTimer()
	interval := time.Second / time.Duration(rate)
	start := time.Now().Add(20 * time.Millisecond)
	for i, ev := range evs {
		time.Sleep(time.Until(start.Add(time.Duration(i) * interval)))
		mu.Lock()
		sent[i] = time.Now()
		mu.Unlock()
		pubs[i%writers].SendEvent(ev)
	}
	sentRate := float64(n) / time.Since(start).Seconds()
	deadline := time.Now().Add(30 * time.Second)
	for {
		mu.Lock()
		done := got["ok"] == n && got["same"] == n && got["cross"] == n
		mu.Unlock()
		if done || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.StopTimer()
	mu.Lock()
	defer mu.Unlock()
	if path := os.Getenv("BUZZ_BENCH_TRACE"); path != "" {
		writeFanoutTrace(b, fmt.Sprintf("%s.%d.csv", path, rate), start, sent, lat)
	}
	res := loadResult{n: n, sentRate: sentRate, got: map[string]int{}, pct: map[string][3]time.Duration{}}
	// Per event, what the replication tail adds beyond the commit returning on A.
	added := make([]time.Duration, 0, n)
	for i := range sent {
		if lat["ok"][i] != 0 && lat["cross"][i] != 0 {
			added = append(added, lat["cross"][i]-lat["ok"][i])
		}
	}
	res.pct["cross-ok"] = pct3(added)
	res.got["cross-ok"] = len(added)
	for k, ds := range lat {
		res.got[k] = got[k]
		var have []time.Duration
		for _, d := range ds {
			if d != 0 {
				have = append(have, d)
			}
		}
		res.pct[k] = pct3(have)
	}
	return res
}

func pct3(ds []time.Duration) [3]time.Duration {
	if len(ds) == 0 {
		return [3]time.Duration{}
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return [3]time.Duration{ds[int(0.50*float64(len(ds)-1))], ds[int(0.99*float64(len(ds)-1))], ds[len(ds)-1]}
}
