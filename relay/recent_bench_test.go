package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// BenchmarkRecentMatching: what one REQ pays in recentStored.matching before any limit applies,
// with the ring full of public events carrying 200 short tags each (the shape of a large contact
// list, or of an attacker keeping the window full), for a REQ with one queried filter (kind 1,
// limit 10) and for one with limit 0 only. Baseline, same run: the matching used before the fix,
// which copied every entry and built each event's tag index again for every REQ.
//
//	go test ./relay -run '^$' -bench RecentMatching
func BenchmarkRecentMatching(b *testing.B) {
	var r recentStored
	now := time.Now()
	for i := 0; i < recentMaxEntries; i++ {
		ev := &nostr.Event{ID: fmt.Sprintf("%064x", i), Kind: 1}
		for j := 0; j < 200; j++ {
			ev.Tags = append(ev.Tags, nostr.Tag{"t", fmt.Sprintf("t%d", j)})
		}
		d := evt.Delivery{Event: ev, Scope: evt.Scope{Kind: evt.ScopePublic}, Xid: uint32(i + 1)}
		r.add(d, newTagIndex(ev), now)
	}
	sub := func(limit int) *subscription {
		cf, err := compileFilter(nostr.Filter{Kinds: []int{1}, Limit: limit, LimitZero: limit == 0}, filterLimits{maxLimit: 5000, defaultLimit: 500})
		if err != nil {
			b.Fatal(err)
		}
		return newSubscription(context.Background(), "s", []*compiledFilter{cf})
	}
	queried, live := sub(10), sub(0)
	before := func(s *subscription) int {
		r.mu.Lock()
		kept := make([]recentEntry, 0, r.n)
		for i := 0; i < r.n; i++ {
			kept = append(kept, *r.ring[(r.head+i)%len(r.ring)])
		}
		r.mu.Unlock()
		n := 0
		for _, e := range kept {
			if now.Sub(e.at) <= recentMaxAge && s.matchesQueried(e.d, newTagIndex(e.d.Event)) {
				n++
			}
		}
		return n
	}
	var base, fixed, limit0 time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		nb := before(queried)
		t1 := time.Now()
		nf := len(takeAll(&r, queried, now))
		t2 := time.Now()
		nz := len(takeAll(&r, live, now))
		t3 := time.Now()
		if nb != r.n || nf != r.n || nz != 0 {
			b.Fatalf("matched %d before, %d now, %d for limit 0; want %d, %d, 0", nb, nf, nz, r.n, r.n)
		}
		base, fixed, limit0 = base+t1.Sub(t0), fixed+t2.Sub(t1), limit0+t3.Sub(t2)
	}
	b.ReportMetric(float64(base.Microseconds())/float64(b.N), "before-µs/req")
	b.ReportMetric(float64(fixed.Microseconds())/float64(b.N), "queried-µs/req")
	b.ReportMetric(float64(limit0.Nanoseconds())/float64(b.N), "limit0-ns/req")
	b.ReportMetric(float64(base)/float64(fixed), "speedup")
}

// BenchmarkRecentSeen: the usual case right after a burst (the load tool's query scenario, which
// starts as seeding ends): the ring full of plain kind 1 events that every REQ's snapshot already
// saw. Before: every entry copied with its age tested, then matched, as matching did until
// 2026-12-03. Now: pointers and ids copied, ids tested, nothing matched.
//
//	go test ./relay -run '^$' -bench RecentSeen
func BenchmarkRecentSeen(b *testing.B) {
	var r recentStored
	now := time.Now()
	for i := 0; i < recentMaxEntries; i++ {
		ev := &nostr.Event{ID: fmt.Sprintf("%064x", i), Kind: 1, Tags: nostr.Tags{{"t", fmt.Sprintf("t%d", i%50)}}}
		r.add(evt.Delivery{Event: ev, Scope: evt.Scope{Kind: evt.ScopePublic}, Xid: uint32(i + 1000)}, newTagIndex(ev), now)
	}
	cf, err := compileFilter(nostr.Filter{Kinds: []int{1}, Limit: 100}, filterLimits{maxLimit: 5000, defaultLimit: 500})
	if err != nil {
		b.Fatal(err)
	}
	sub := newSubscription(context.Background(), "s", []*compiledFilter{cf})
	snap := &mvccSnapshot{xmin: 5000, xmax: 5000} // saw every one
	before := func() int {
		r.mu.Lock()
		kept := make([]*recentEntry, 0, r.n)
		for i := 0; i < r.n; i++ {
			if e := r.ring[(r.head+i)%len(r.ring)]; now.Sub(e.at) <= recentMaxAge {
				kept = append(kept, e)
			}
		}
		r.mu.Unlock()
		var matched []evt.Delivery
		for _, e := range kept {
			if sub.matchesQueried(e.d, e.ix) {
				matched = append(matched, e.d)
			}
		}
		n := 0
		for _, d := range matched {
			if !snap.sees(d.Xid) {
				n++
			}
		}
		return n
	}
	var old, cur time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		nb := before()
		t1 := time.Now()
		nn := len(r.take(sub, now).unseen(snap, sub))
		t2 := time.Now()
		if nb != 0 || nn != 0 {
			b.Fatalf("%d and %d unseen; want none", nb, nn)
		}
		old, cur = old+t1.Sub(t0), cur+t2.Sub(t1)
	}
	b.ReportMetric(float64(old.Microseconds())/float64(b.N), "before-µs/req")
	b.ReportMetric(float64(cur.Microseconds())/float64(b.N), "now-µs/req")
}
