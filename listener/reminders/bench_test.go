package reminders

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/fanout"
)

// BenchmarkReminderLateness: lateness = time the due signal reached this process's fan-out sink
// (through the real replication tail) minus not_before, and emit lateness = confirmed_at minus
// not_before from the database, for
//   - sparse: BUZZ_BENCH_SPARSE_SECONDS (default 10) consecutive seconds, 3 reminders due in each;
//   - burst: BUZZ_BENCH_BURST (default 10000) reminders due in the same second,
//
// with two Schedulers (default config: batch 500) in this process sharing one database, and
// one Fanout as the delivering side. Duplicates (a version delivered twice) fail the benchmark.
// The multi-process variant is tests/reminder_serve_test.go (TestReminderBurstTwoProcesses).
//
//	go test ./listener/reminders -run '^$' -bench ReminderLateness -benchtime 1x
func BenchmarkReminderLateness(b *testing.B) {
	for _, sc := range []struct {
		name string
		run  func(b *testing.B, h *benchHarness)
	}{
		{"sparse", func(b *testing.B, h *benchHarness) {
			secs := testenv.EnvInt("BUZZ_BENCH_SPARSE_SECONDS", 10)
			start := time.Now().Unix() + 2
			var nbs []int64
			for i := 0; i < secs; i++ {
				nbs = append(nbs, start+int64(i), start+int64(i), start+int64(i))
			}
			h.run(b, nbs)
		}},
		{"burst", func(b *testing.B, h *benchHarness) {
			n := testenv.EnvInt("BUZZ_BENCH_BURST", 10000)
			h.run(b, nil, n)
		}},
	} {
		b.Run(sc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				sc.run(b, newBenchHarness(b))
			}
		})
	}
}

type benchHarness struct {
	url  string
	e    *env
	mu   sync.Mutex
	got  map[string][]time.Time // due deliveries per event id
	want map[string]int64       // id -> not_before
	all  chan struct{}
}

func newBenchHarness(b *testing.B) *benchHarness {
	u := testenv.FreshDB(b)
	h := &benchHarness{url: u, got: map[string][]time.Time{}, want: map[string]int64{}, all: make(chan struct{})}
	h.e = &env{t: b, url: u, pool: testenv.Pool(b, u)}
	h.e.sk, _ = testenv.NewKey()
	return h
}

// run stores reminders with the given not_befores (or burst ones, all due in one second a few
// seconds after they are stored), runs the schedulers and waits for every due delivery.
func (h *benchHarness) run(b *testing.B, nbs []int64, burst ...int) {
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	sink := testenv.Sink{Due: func(d evt.Due) {
		now := time.Now()
		h.mu.Lock()
		defer h.mu.Unlock()
		h.got[d.Event.ID] = append(h.got[d.Event.ID], now)
		if len(h.got) == len(h.want) && len(h.want) > 0 {
			select {
			case <-h.all:
			default:
				close(h.all)
			}
		}
	}}
	f := fanout.New(fanout.Config{DatabaseURL: h.url, InstanceID: fmt.Sprintf("rb_%d", time.Now().UnixNano()%1e9), Logger: quiet}, h.e.pool, sink)
	fctx, fcancel := context.WithCancel(ctx)
	go f.Run(fctx)
	defer func() {
		fcancel()
		cctx, c := context.WithTimeout(ctx, 10*time.Second)
		defer c()
		f.Close(cctx)
	}()
	for !f.Ready() {
		time.Sleep(5 * time.Millisecond)
	}
	// Two schedulers, started before the reminders are stored (they sleep until not_before).
	for i := 0; i < 2; i++ {
		h.e.start(fmt.Sprint("bench", i), Config{Logger: benchLogger(b), BatchSize: testenv.EnvInt("BUZZ_BENCH_BATCH", 500)})
	}

	t0 := time.Now()
	if len(burst) > 0 {
		// Setup, not measured: bulk-insert the rows accept_event would write (event + armed
		// reminder), all due in one second. Signing and accept_event for 10,000 events take tens
		// of seconds on a loaded 2-CPU box, longer than any sane lead time; the measured path
		// (sleep, claim, confirm/emit, replication, sink) is the same.
		n := burst[0]
		nb := time.Now().Unix() + 4
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("%064x", uint64(time.Now().UnixNano())+uint64(i)*0x9e3779b97f4a7c15)
			h.want[ids[i]] = nb
		}
		_, pk := testenv.NewKey()
		_, err := h.e.pool.Exec(ctx, `
			WITH ins AS (
			  INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, d_tag, scope)
			  SELECT id, $2, $3 - 60, 30300, jsonb_build_array(jsonb_build_array('d', 'b' || n), jsonb_build_array('not_before', $3::text)),
			         'enc', repeat('0', 128), 'b' || n, 'a'
			    FROM unnest($1::text[]) WITH ORDINALITY AS u(id, n)
			  RETURNING id, d_tag)
			INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before)
			SELECT id, $2, d_tag, $3 - 60, $3 FROM ins`, ids, pk, nb)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := h.e.pool.Exec(ctx, `SELECT pg_notify('buzz_reminders', $1)`, fmt.Sprint(nb)); err != nil {
			b.Fatal(err)
		}
	} else {
		var evs []*nostr.Event
		for i, nb := range nbs {
			ev := signedReminder(b, h.e.sk, fmt.Sprint("sparse", i), nb)
			evs = append(evs, ev)
			h.want[ev.ID] = nb
		}
		for _, ev := range evs {
			raw, _ := json.Marshal(ev)
			if _, err := h.e.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(raw)); err != nil {
				b.Fatal(err)
			}
		}
	}
	var early int
	var states string
	_ = h.e.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state <> 'armed'), string_agg(DISTINCT state, ',') FROM buzz.reminders`).Scan(&early, &states)
	if early > 0 {
		b.Fatalf("%d reminders (%s) were due before all were stored (in %s); raise the lead time",
			early, states, time.Since(t0))
	}
	b.ResetTimer()
	select {
	case <-h.all:
	case <-time.After(time.Duration(len(h.want)/100+60) * time.Second):
		h.mu.Lock()
		b.Fatalf("only %d of %d due signals delivered", len(h.got), len(h.want))
	}
	b.StopTimer()
	// Quiet period: a late duplicate would show up here.
	time.Sleep(500 * time.Millisecond)

	h.mu.Lock()
	defer h.mu.Unlock()
	var deliv []time.Duration
	dups := 0
	for id, ts := range h.got {
		if len(ts) > 1 {
			dups += len(ts) - 1
		}
		deliv = append(deliv, ts[0].Sub(time.Unix(h.want[id], 0)))
	}
	rows, err := h.e.pool.Query(ctx, `SELECT extract(epoch FROM confirmed_at - to_timestamp(not_before)) FROM buzz.reminders WHERE state = 'confirmed'`)
	if err != nil {
		b.Fatal(err)
	}
	var emit []time.Duration
	for rows.Next() {
		var s float64
		_ = rows.Scan(&s)
		emit = append(emit, time.Duration(s*float64(time.Second)))
	}
	rows.Close()
	dp, ep := testenv.Percentiles(deliv), testenv.Percentiles(emit)
	b.Logf("%d reminders, 2 schedulers (batch 500) + 1 fan-out in one process", len(h.want))
	b.Logf("emit (confirmed_at - not_before): p50 %s p99 %s max %s", ep[0], ep[1], ep[2])
	b.Logf("delivered to sink - not_before:   p50 %s p99 %s max %s; duplicates %d", dp[0], dp[1], dp[2], dups)
	b.ReportMetric(ms(dp[0]), "deliv-p50-ms")
	b.ReportMetric(ms(dp[1]), "deliv-p99-ms")
	b.ReportMetric(ms(dp[2]), "deliv-max-ms")
	b.ReportMetric(ms(ep[0]), "emit-p50-ms")
	b.ReportMetric(ms(ep[1]), "emit-p99-ms")
	b.ReportMetric(float64(dups), "duplicates")
	if dups > 0 {
		b.Errorf("%d duplicate due deliveries", dups)
	}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func signedReminder(t testing.TB, sk, d string, nb int64) *nostr.Event {
	ev := &nostr.Event{Kind: 30300, CreatedAt: nostr.Now(), Content: "enc",
		Tags: nostr.Tags{{"d", d}, {"not_before", fmt.Sprint(nb)}}}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// benchLogger: quiet unless BUZZ_BENCH_LOG names a file (then the schedulers' per-batch timings).
func benchLogger(t testing.TB) *slog.Logger {
	if p := os.Getenv("BUZZ_BENCH_LOG"); p != "" {
		f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err == nil {
			t.Cleanup(func() { f.Close() })
			return slog.New(slog.NewTextHandler(f, &slog.HandlerOptions{Level: slog.LevelDebug}))
		}
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}
