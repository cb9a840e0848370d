package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkAcceptEvent measures buzz.accept_event throughput from Go (kind 1, pre-signed) on 1 and
// 8 connections, beside a baseline measured in the same run with the same concurrency: a plain
// single-row INSERT + COMMIT of the same event JSON into a table without triggers or indexes
// beyond its primary key. Reported: accepted/s, baseline/s and their ratio.
//
//	go test -tags libsecp256k1 -run '^$' -bench AcceptEvent -benchtime 4000x ./internal/store/
func BenchmarkAcceptEvent(b *testing.B) {
	url := testenv.DB(b)
	ctx := context.Background()
	pool := testenv.Pool(b, url)
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS bench_baseline (id text PRIMARY KEY, ev jsonb NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	for _, conns := range []int{1, 8} {
		b.Run(fmt.Sprintf("conns=%d", conns), func(b *testing.B) {
			p, err := pgxpool.New(ctx, url+"&pool_max_conns="+fmt.Sprint(conns))
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			evs := presign(b, b.N)
			raws := make([][]byte, len(evs))
			for i, ev := range evs {
				raws[i], _ = json.Marshal(ev)
			}
			b.ResetTimer()
			base := run(conns, len(raws), func(i int) error {
				_, err := p.Exec(ctx, `INSERT INTO bench_baseline (id, ev) VALUES ($1, $2::jsonb)`, evs[i].ID, string(raws[i]))
				return err
			})
			acc := run(conns, len(raws), func(i int) error {
				ok, msg, err := store.AcceptJSON(ctx, p, raws[i])
				if err == nil && (!ok || msg != "") {
					err = fmt.Errorf("not accepted: %v %q", ok, msg)
				}
				return err
			})
			b.StopTimer()
			if base.err != nil || acc.err != nil {
				b.Fatal(base.err, acc.err)
			}
			b.ReportMetric(acc.rate, "accepted/s")
			b.ReportMetric(base.rate, "insert+commit/s")
			b.ReportMetric(acc.rate/base.rate, "ratio")
		})
	}
}

type outcome struct {
	rate float64
	err  error
}

// run calls do(i) for i in [0, n) from conns goroutines and returns calls per second.
func run(conns, n int, do func(i int) error) outcome {
	var next int64
	var mu sync.Mutex
	var firstErr error
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < conns; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				i := next
				next++
				mu.Unlock()
				if int(i) >= n {
					return
				}
				if err := do(int(i)); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return outcome{rate: float64(n) / time.Since(start).Seconds(), err: firstErr}
}

func presign(b *testing.B, n int) []*nostr.Event {
	users := make([]testenv.User, 16)
	for i := range users {
		users[i] = testenv.NewUser()
	}
	evs := make([]*nostr.Event, n)
	for i := range evs {
		evs[i] = users[i%len(users)].Event(b, 1, nostr.Tags{{"t", "bench"}}, fmt.Sprintf("bench %d", i))
	}
	return evs
}
