package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkAcceptEventsCPU measures what buzz.accept_events costs the PostgreSQL backend per
// stored event (CPU time read from /proc, so a busy host moves it less than a rate), for batches
// of plain kind 1 events (the set-based path) and of one event, with no tag, one t tag, or three
// tags (t, p, e: each a row of buzz.event_tags). Needs the server on this host.
//
//	go test -tags libsecp256k1 -run '^$' -bench AcceptEventsCPU -benchtime 3000x ./internal/store/
func BenchmarkAcceptEventsCPU(b *testing.B) {
	url := testenv.DB(b)
	ctx := context.Background()
	for _, sh := range []struct{ size, tags int }{{50, 0}, {50, 1}, {50, 3}, {1, 0}, {1, 1}, {1, 3}} {
		size, tags := sh.size, sh.tags
		b.Run(fmt.Sprintf("batch=%d/tags=%d", size, tags), func(b *testing.B) {
			c, err := pgx.Connect(ctx, url)
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close(ctx)
			var pid int
			if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				b.Fatal(err)
			}
			evs := presignTagged(b, b.N, tags)
			var batches []string
			for i := 0; i < len(evs); i += size {
				arr, _ := json.Marshal(evs[i:min(i+size, len(evs))])
				batches = append(batches, string(arr))
			}
			b.ResetTimer()
			cpu0, start := backendCPU(b, pid), time.Now()
			for _, arr := range batches {
				rows, err := c.Query(ctx, `SELECT ok, message FROM buzz.accept_events($1::jsonb)`, arr)
				if err != nil {
					b.Fatal(err)
				}
				for rows.Next() {
					var ok bool
					var msg string
					if err := rows.Scan(&ok, &msg); err != nil || !ok || msg != "" {
						b.Fatalf("not accepted: %v %q %v", ok, msg, err)
					}
				}
				if rows.Err() != nil {
					b.Fatal(rows.Err())
				}
			}
			b.StopTimer()
			b.ReportMetric(float64((backendCPU(b, pid)-cpu0).Microseconds())/float64(b.N), "pg-µs/event")
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "accepted/s")
		})
	}
}

// backendCPU is the user+system CPU time of process pid so far (/proc/pid/stat, clock ticks of
// 10 ms).
func backendCPU(b *testing.B, pid int) time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		b.Skipf("backend CPU not readable (server on another host?): %v", err)
	}
	f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
	ut, _ := strconv.Atoi(f[11])
	st, _ := strconv.Atoi(f[12])
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// presignTagged is presign with n tags per event: none, a t tag, or a t, a p and an e tag.
func presignTagged(b *testing.B, n, tags int) []*nostr.Event {
	users := make([]testenv.User, 16)
	for i := range users {
		users[i] = testenv.NewUser()
	}
	all := nostr.Tags{{"t", "bench"}, {"p", users[0].PK}, {"e", strings.Repeat("ab", 32)}}
	evs := make([]*nostr.Event, n)
	for i := range evs {
		evs[i] = users[i%len(users)].Event(b, 1, all[:tags], fmt.Sprintf("bench %d", i))
	}
	return evs
}
