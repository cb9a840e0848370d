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

// BenchmarkUnwantedEvents measures what live delivery spends on events nobody here wants, with
// 2,000 connections, each authenticated and subscribed to its viewer's snapshots and to a feed of
// 50 authors (kinds 1, 6, 7):
//
//   - a DM event whose members are not cached (Deliver decides to skip the member lookup): the
//     interest index beside, in the same run, the walk over every authenticated connection's
//     subscriptions that decided it alone before (dm_index_ns/op, dm_walk_ns/op; and
//     dm_candidates_ns/op, the exact check over the index's candidates that follows a "maybe");
//
//   - a public event (kind 1): Deliver with the index naming the candidate connections, beside
//     every connection offered the event, as before the index (pub_index_ns/op, pub_walk_ns/op).
//
//     go test ./relay -run '^$' -bench UnwantedEvents
func BenchmarkUnwantedEvents(b *testing.B) {
	const n = 2000
	tr := startRelay(b, func(c *Config) { c.MaxConns, c.MaxConnsPerIP = n+10, n+10 })
	for i := 0; i < n; i++ {
		sk, pk := testenv.NewKey()
		c := tr.dial(b)
		c.mustAuth(sk, tr.url)
		c.req("snap", nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": []string{pk}}})
		follows := make([]string, 50) // a feed: what 50 others post, none of them the event's author
		for j := range follows {
			follows[j] = randHex64()
		}
		c.req("feed", nostr.Filter{Kinds: []int{1, 6, 7}, Authors: follows, Limit: 1})
	}
	dm := nostr.Event{ID: randHex64(), Kind: 9, Tags: nostr.Tags{{"h", "00000000-0000-4000-8000-000000000000"}}}
	dmd := live{Delivery: evt.Delivery{Event: &dm, Scope: evt.Scope{Kind: evt.ScopeChannel, Channel: dm.Tags[0][1]}}}
	dmix := newTagIndex(&dm)
	pub := nostr.Event{ID: randHex64(), Kind: 1, PubKey: randHex64(), Content: "nobody listens"}
	pubd := evt.Delivery{Event: &pub, Scope: evt.Scope{Kind: evt.ScopePublic}}
	pubJS := eventJSON(&pub)
	cases := []struct {
		name string
		f    func()
		d    time.Duration
	}{
		{"dm_walk", func() {
			if walkAuthed(tr.s, dmd, dmix) {
				b.Fatal("the walk found a subscription for a DM nobody here reads")
			}
		}, 0},
		{"dm_index", func() {
			if tr.s.interest.mayMatch(&dm) {
				b.Fatal("the index counts interest in a DM nobody here reads")
			}
		}, 0},
		{"dm_candidates", func() {
			if tr.s.anySubscriptionMatches(dmd, dmix) {
				b.Fatal("the candidates' subscriptions match a DM nobody here reads")
			}
		}, 0},
		{"pub_walk", func() {
			for _, c := range tr.s.snapshotConns() {
				c.deliver(live{Delivery: pubd}, pubJS, nil)
			}
		}, 0},
		{"pub_index", func() { tr.s.DeliverEvent(pubd) }, 0},
	}
	const perRound = 200
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for k := range cases { // alternated per round: the same machine load for each
			t0 := time.Now()
			for j := 0; j < perRound; j++ {
				cases[k].f()
			}
			cases[k].d += time.Since(t0)
		}
	}
	ops := float64(b.N * perRound)
	for _, c := range cases {
		b.ReportMetric(float64(c.d.Nanoseconds())/ops, c.name+"_ns/op")
	}
}

// walkAuthed is the DM pre-check before the interest index: every authenticated connection's
// subscriptions, matched one by one.
func walkAuthed(s *Server, d live, ix tagIndex) bool {
	s.mu.RLock()
	var conns []*conn
	for _, set := range s.byPubkey {
		for c := range set {
			conns = append(conns, c)
		}
	}
	s.mu.RUnlock()
	for _, c := range conns {
		if c.anySubMatches(d, ix) {
			return true
		}
	}
	return false
}
