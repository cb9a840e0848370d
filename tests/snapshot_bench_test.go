package tests

// End-to-end NIP-DV convergence through a real `buzzpg serve`: a resurfacing message accepted
// over the relay → the viewer's live subscription receives the new snapshot.
//
//	go test ./tests -run '^$' -bench SnapshotServeConvergence -benchtime 1x -v
//	(BUZZ_BENCH_RATE overrides the 500 messages/s, BUZZ_BENCH_VIEWERS the 500 viewers and
//	BUZZ_BENCH_ROUNDS the 3 rounds; BUZZ_BUILD_TAGS="testhooks libsecp256k1"
//	builds the relay with cgo signatures)

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func BenchmarkSnapshotServeConvergence(b *testing.B) {
	rate := testenv.EnvInt("BUZZ_BENCH_RATE", 500)
	// Each round hides every viewer's DM, then resurfaces it (one message per viewer). Every
	// snapshot of a viewer needs a created_at one second above the last (NIP-01 replacement), and
	// the publisher runs at most snapshot_max_ahead_seconds (10) ahead of the clock: a viewer
	// changed more than once a second for long uses that up and then waits (docs/design.md, Decisions). With
	// 500 viewers at 500/s a round spends two of a viewer's seconds in about 1.5 s, so more than
	// ~10 rounds measure that wait, not convergence: longer runs need more viewers
	// (BUZZ_BENCH_VIEWERS=2000 BUZZ_BENCH_ROUNDS=15 is a minute at 500/s).
	viewers, rounds := testenv.EnvInt("BUZZ_BENCH_VIEWERS", 500), testenv.EnvInt("BUZZ_BENCH_ROUNDS", 3)
	dbURL := testenv.FreshDB(b)
	pool := testenv.Pool(b, dbURL)
	ctx := context.Background()
	relayKey, _ := testenv.NewKey()
	env := map[string]string{"BUZZ_LOG_LEVEL": "info", "BUZZ_IP_MAX_CONNS": strconv.Itoa(viewers + 100)}
	for _, kv := range strings.Fields(os.Getenv("BUZZ_BENCH_RELAY_ENV")) { // e.g. BUZZ_DEBUG_LISTEN=127.0.0.1:6070
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	r := testenv.StartRelay(b, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: relayKey, Env: env})

	senderSK, senderPK := testenv.NewKey()
	type viewer struct {
		pk, ch string
		c      *testenv.Client
	}
	// Per viewer and round: when the sender saw the OK of its resurfacing message, and when the
	// viewer's live subscription got a snapshot with nothing hidden (either may come first).
	type sample struct{ ok, snap time.Time }
	var mu sync.Mutex
	cur := map[string]*sample{}      // viewer -> this round's sample
	hidSeen := map[string]bool{}     // viewer -> this round's hide snapshot arrived
	msgViewer := map[string]string{} // message id -> viewer
	var done []*sample
	refused := 0
	var lastOK time.Time
	vs := make([]*viewer, viewers)
	for i := range vs {
		sk, pk := testenv.NewKey()
		v := &viewer{pk: pk}
		if err := pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, senderPK, pk).Scan(&v.ch); err != nil {
			b.Fatal(err)
		}
		v.c = testenv.Dial(b, r.URL, testenv.OnEvent(func(sub string, ev *nostr.Event, at time.Time) {
			mu.Lock()
			defer mu.Unlock()
			if len(snapHidden(ev)) != 0 {
				hidSeen[pk] = true // a hide's snapshot, not the resurfacing one
				return
			}
			if x := cur[pk]; x != nil && x.snap.IsZero() {
				x.snap = at
			}
		}))
		v.c.Auth(sk)
		v.c.Subscribe(nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": []string{pk}}})
		vs[i] = v
	}
	// Several sender connections: the relay answers one connection's EVENTs in order, one at a
	// time, so a single connection cannot carry 500 accepted messages/s and the rate the database
	// saw would be lower than the one offered.
	onOK := testenv.OnOK(func(id string, accepted bool, _ string, at time.Time) {
		mu.Lock()
		defer mu.Unlock()
		if v, ok := msgViewer[id]; ok && cur[v] != nil && cur[v].ok.IsZero() {
			cur[v].ok = at
			if at.After(lastOK) {
				lastOK = at
			}
			if !accepted {
				refused++
			}
		}
	})
	senders := make([]*testenv.Client, 8)
	for i := range senders {
		senders[i] = testenv.Dial(b, r.URL, onOK)
		senders[i].Auth(senderSK)
	}
	all := make([]string, viewers)
	for i, v := range vs {
		all[i] = v.pk
	}
	slices.Sort(all)
	converged := func() bool {
		var n int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM buzz.visibility_state WHERE viewer = ANY($1) AND published_generation < target_generation`, all).Scan(&n)
		return n == 0
	}

	b.ResetTimer()
	var offered, accepted float64 // messages/s sent, and accepted (first send to last OK)
	// Round -1 warms up and is not measured: the relay's acceptance connections are opened and
	// accept_event's plan compiled on first use, which stalled the first ~100 ms of a cold run.
	for round := -1; round < rounds; round++ {
		// Hide every DM (sorted by viewer: the documented lock order), wait for those snapshots.
		snapExec(b, pool, `SELECT buzz.hide_dm(m.pubkey, m.channel_id) FROM
			(SELECT pubkey, channel_id FROM buzz.members WHERE pubkey = ANY($1) AND hidden_at IS NULL ORDER BY pubkey) m`, all)
		testenv.WaitUntil(b, time.Minute, "hides published", converged)
		// ... and delivered: a round must not start behind the replication backlog of its own
		// setup (500 hide snapshots), or the first resurfacing snapshots queue behind it.
		testenv.WaitUntil(b, time.Minute, "hide snapshots received", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(hidSeen) == viewers
		})
		mu.Lock()
		clear(hidSeen)
		mu.Unlock()
		// Resurface them: one message per viewer, paced by schedule (message i at t0 + i/rate;
		// a late one goes at once) and signed beforehand. A ticker drops the ticks a busy sender
		// misses, which held the offered rate near 430/s instead of 500/s.
		msgs := make([]*nostr.Event, len(vs))
		for i, v := range vs {
			msgs[i] = snapEvent(b, senderSK, 9, "ping", nostr.Tag{"h", v.ch})
		}
		t0 := time.Now()
		for i, v := range vs {
			time.Sleep(time.Until(t0.Add(time.Duration(i) * time.Second / time.Duration(rate))))
			ev := msgs[i]
			mu.Lock()
			msgViewer[ev.ID] = v.pk
			cur[v.pk] = &sample{}
			mu.Unlock()
			senders[i%len(senders)].SendEvent(ev)
		}
		sent := time.Since(t0)
		testenv.WaitUntil(b, time.Minute, "resurfacing snapshots received", func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, x := range cur {
				if x.ok.IsZero() || x.snap.IsZero() {
					return false
				}
			}
			return true
		})
		mu.Lock()
		if round >= 0 {
			offered += float64(viewers) / sent.Seconds() / float64(rounds)
			accepted += float64(viewers) / lastOK.Sub(t0).Seconds() / float64(rounds)
		}
		var roundLat []time.Duration
		for _, x := range cur {
			if round >= 0 {
				done = append(done, x)
			}
			roundLat = append(roundLat, max(0, x.snap.Sub(x.ok)))
		}
		if slices.Sort(roundLat); rounds > 3 {
			// Per round, so a run that degrades over time shows where.
			b.Logf("round %d: p50 %s p99 %s max %s", round, roundLat[len(roundLat)/2],
				roundLat[len(roundLat)*99/100], roundLat[len(roundLat)-1])
		}
		cur = map[string]*sample{}
		mu.Unlock()
		if refused > 0 {
			b.Fatalf("%d messages refused", refused)
		}
	}
	b.StopTimer()
	var lat []time.Duration
	early := 0
	for _, x := range done {
		d := x.snap.Sub(x.ok)
		if d < 0 {
			d, early = 0, early+1
		}
		lat = append(lat, d)
	}
	slices.Sort(lat)
	q := func(f float64) time.Duration { return lat[int(f*float64(len(lat)-1))] }
	b.ReportMetric(offered, "msgs/s")
	b.ReportMetric(accepted, "accepted/s")
	b.ReportMetric(float64(q(0.5).Microseconds())/1000, "p50_ms")
	b.ReportMetric(float64(q(0.99).Microseconds())/1000, "p99_ms")
	b.Logf("%d resurfacing messages sent at %.0f/s, accepted at %.0f/s (%d viewers, 8 sender connections, one relay process, publisher 4 workers, after a warm-up round): accepted (OK) -> live snapshot p50 %s p99 %s max %s (%d arrived before the sender saw its OK)",
		len(lat), offered, accepted, viewers, q(0.5), q(0.99), lat[len(lat)-1], early)
}
