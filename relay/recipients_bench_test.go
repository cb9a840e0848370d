package relay

import (
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkScopedRecipients measures finding the readers of a p-scoped event (a viewer's
// snapshot) among 2,000 authenticated connections, beside, in the same run, the walk over every
// connection with its read gate that Deliver did before the index (the baseline). Reported:
// index_ns/op, walk_ns/op and their ratio.
//
//	go test ./relay -run '^$' -bench ScopedRecipients
func BenchmarkScopedRecipients(b *testing.B) {
	const n = 2000
	tr := startRelay(b, func(c *Config) { c.MaxConns, c.MaxConnsPerIP = n+10, n+10 })
	pks := make([]string, n)
	for i := range pks {
		sk, pk := testenv.NewKey()
		c := tr.dial(b)
		c.mustAuth(sk, tr.url)
		pks[i] = pk
	}
	ev := nostr.Event{ID: randHex64(), Kind: 30622}
	noMembers := func(string, string) bool { return false }
	// Both ways are timed inside one benchmark, alternating per round, so the ratio compares
	// them under the same machine load (testing.Benchmark cannot nest inside a benchmark).
	walkOnce := func(d evt.Delivery) int {
		k := 0
		for _, c := range tr.s.snapshotConns() {
			if d.Scope.Readable(d.Event.PubKey, c.authedList(), noMembers) {
				k++
			}
		}
		return k
	}
	indexOnce := func(d evt.Delivery) int {
		k := 0
		for _, c := range tr.s.recipients(d, nil) {
			if d.Scope.Readable(d.Event.PubKey, c.authedList(), noMembers) {
				k++
			}
		}
		return k
	}
	const perRound = 200
	var walkD, indexD time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, w := range []struct {
			f   func(evt.Delivery) int
			acc *time.Duration
		}{{walkOnce, &walkD}, {indexOnce, &indexD}} {
			t0 := time.Now()
			for j := 0; j < perRound; j++ {
				d := evt.Delivery{Event: &ev, Scope: evt.Scope{Kind: evt.ScopeP, P: pks[(i*perRound+j)%n]}}
				if w.f(d) != 1 {
					b.Fatalf("a viewer's event found %d readers, want exactly 1", w.f(d))
				}
			}
			*w.acc += time.Since(t0)
		}
	}
	ops := float64(b.N * perRound)
	walk, index := float64(walkD.Nanoseconds())/ops, float64(indexD.Nanoseconds())/ops
	b.ReportMetric(index, "index_ns/op")
	b.ReportMetric(walk, "walk_ns/op")
	b.ReportMetric(index/walk, "ratio")
}

// BenchmarkUncachedDMPrecheck measures what Deliver spends deciding that no subscription here
// wants an event of a DM whose members it has not cached (so it skips the member lookup), with
// 2,000 authenticated viewers each subscribed to their own snapshots: the interest index, beside,
// in the same run, the walk over every connection's subscriptions that decided it alone before
// (the baseline). Reported: index_ns/op, walk_ns/op and their ratio.
//
//	go test ./relay -run '^$' -bench UncachedDMPrecheck
func BenchmarkUncachedDMPrecheck(b *testing.B) {
	const n = 2000
	tr := startRelay(b, func(c *Config) { c.MaxConns, c.MaxConnsPerIP = n+10, n+10 })
	for i := 0; i < n; i++ {
		sk, pk := testenv.NewKey()
		c := tr.dial(b)
		c.mustAuth(sk, tr.url)
		c.req("snap", nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": []string{pk}}})
	}
	ev := nostr.Event{ID: randHex64(), Kind: 9, Tags: nostr.Tags{{"h", "00000000-0000-4000-8000-000000000000"}}}
	d := evt.Delivery{Event: &ev, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: ev.Tags[0][1]}}
	ix := newTagIndex(&ev)
	const perRound = 200
	var walkD, indexD time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		for j := 0; j < perRound; j++ {
			if tr.s.anySubscriptionMatches(d, ix) {
				b.Fatal("the walk found a subscription for a DM nobody here reads")
			}
		}
		walkD += time.Since(t0)
		t0 = time.Now()
		for j := 0; j < perRound; j++ {
			if tr.s.interest.mayMatch(&ev) {
				b.Fatal("the index counts interest in a DM nobody here reads")
			}
		}
		indexD += time.Since(t0)
	}
	ops := float64(b.N * perRound)
	walk, index := float64(walkD.Nanoseconds())/ops, float64(indexD.Nanoseconds())/ops
	b.ReportMetric(index, "index_ns/op")
	b.ReportMetric(walk, "walk_ns/op")
	b.ReportMetric(index/walk, "ratio")
}
