package relay

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// The indexed tag match (events with many tags, live delivery) agrees with the plain one on
// random events and filters, on both sides of indexTagsFrom and both of its branches (fewer or
// more values than the event has tags).
func TestIndexedTagMatchAgrees(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	val := func() string { return fmt.Sprintf("v%d", rng.IntN(60)) }
	letters := []string{"e", "p", "t", "E"}
	indexed := 0
	for round := 0; round < 4000; round++ {
		ev := &nostr.Event{Kind: 1}
		for i, n := 0, rng.IntN(3*indexTagsFrom); i < n; i++ {
			tag := nostr.Tag{letters[rng.IntN(len(letters))], val()}
			if rng.IntN(10) == 0 {
				tag = nostr.Tag{"expiration"} // short and multi-letter tags are never indexed
			}
			ev.Tags = append(ev.Tags, tag)
		}
		f := nostr.Filter{Tags: nostr.TagMap{}}
		for i, n := 0, 1+rng.IntN(2); i < n; i++ {
			var vs []string
			for j, m := 0, 1+rng.IntN(2*indexTagsFrom); j < m; j++ {
				vs = append(vs, val())
			}
			f.Tags[letters[rng.IntN(len(letters))]] = vs
		}
		cf, err := compileFilter(f, filterLimits{maxLimit: 10, defaultLimit: 10})
		if err != nil {
			t.Fatal(err)
		}
		ix := newTagIndex(ev)
		if ix != nil {
			indexed++
		}
		if plain, fast := cf.matchesIndexed(ev, nil, false), cf.matchesIndexed(ev, ix, false); plain != fast {
			t.Fatalf("round %d: plain %v, indexed %v\nevent tags %v\nfilter %v", round, plain, fast, ev.Tags, f.Tags)
		}
	}
	if indexed < 1000 {
		t.Fatalf("only %d of 4000 events were indexed", indexed)
	}
}

// What all live subscriptions of one connection list is bounded (maxConnFilterValues): each live
// event is matched against them on the one fan-out goroutine. A REQ replacing a subscription of
// the same id does not count the one it replaces.
func TestConnectionFilterValuesCap(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	values := func(prefix string, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("%s%d", prefix, i)
		}
		return out
	}
	// 6 filters × 1,000 values: 6,000, within the cap.
	big := func(prefix string, filters int) []nostr.Filter {
		fs := make([]nostr.Filter, filters)
		for i := range fs {
			fs[i] = nostr.Filter{Tags: nostr.TagMap{"t": values(fmt.Sprintf("%s-%d-", prefix, i), maxFilterValues)}}
		}
		return fs
	}
	c.req("a", big("a", 6)...)
	c.req("a", big("a2", 6)...) // replaces "a": still 6,000
	if _, closed := c.reqOrClosed("b", big("b", 5)...); !strings.HasPrefix(closed, "restricted: too many filter values") {
		t.Fatalf("a second 5,000 values on the connection: closed %q, want restricted:", closed)
	}
	// The refused REQ registered nothing; a small one still fits. Live delivery through the
	// indexed match (events with many tags): the first event the subscription sees is the one
	// that carries its value.
	sk, _ := testenv.NewKey()
	c.req("small", nostr.Filter{Tags: nostr.TagMap{"t": {"x"}}})
	manyTags := func(content string, last string) nostr.Event {
		tags := make(nostr.Tags, 0, 3*indexTagsFrom)
		for i := 0; i < cap(tags)-1; i++ {
			tags = append(tags, nostr.Tag{"t", fmt.Sprintf("other%d", i)})
		}
		return signed(sk, 1, content, nostr.Now(), append(tags, nostr.Tag{"t", last})...)
	}
	miss, hit := manyTags("miss", "y"), manyTags("hit", "x")
	tr.s.DeliverEvent(publicDelivery(&miss))
	tr.s.DeliverEvent(publicDelivery(&hit))
	if got := c.nextEvent("small"); got.ID != hit.ID {
		t.Fatalf("first live event %q, want %q", got.Content, hit.Content)
	}
	// Closing "a" frees its values.
	c.sendJSON("CLOSE", "a")
	c.req("b", big("b", 5)...)
}

// BenchmarkMatchManyTags: one connection's worth of filters at the cap (10 filters × 1,000 #e
// values) against an event with 2,000 e tags that match none, the shape a client could use to
// stall the fan-out goroutine. Baseline, same run: the linear scan matching used before
// (each event tag looked up with slices.Contains in each filter's values).
//
//	go test ./relay -run '^$' -bench MatchManyTags
func BenchmarkMatchManyTags(b *testing.B) {
	var filters []*compiledFilter
	for i := 0; i < maxConnFilterValues/maxFilterValues; i++ {
		vs := make([]string, maxFilterValues)
		for j := range vs {
			vs[j] = fmt.Sprintf("%064d", i*maxFilterValues+j)
		}
		cf, err := compileFilter(nostr.Filter{Tags: nostr.TagMap{"e": vs}}, filterLimits{maxLimit: 10, defaultLimit: 10})
		if err != nil {
			b.Fatal(err)
		}
		filters = append(filters, cf)
	}
	ev := &nostr.Event{Kind: 1}
	for i := 0; i < 2000; i++ {
		ev.Tags = append(ev.Tags, nostr.Tag{"e", fmt.Sprintf("x%063d", i)})
	}
	linear := func() bool {
		for _, cf := range filters {
			for _, t := range ev.Tags {
				if len(t) >= 2 && t[0] == "e" && slices.Contains(cf.tags[0].values, t[1]) {
					return true
				}
			}
		}
		return false
	}
	indexed := func() bool {
		ix := newTagIndex(ev)
		for _, cf := range filters {
			if cf.matchesIndexed(ev, ix, false) {
				return true
			}
		}
		return false
	}
	var base, now time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if linear() {
			b.Fatal("matched")
		}
		t1 := time.Now()
		if indexed() {
			b.Fatal("matched")
		}
		base, now = base+t1.Sub(t0), now+time.Since(t1)
	}
	b.ReportMetric(float64(base.Microseconds())/float64(b.N), "linear-µs/event")
	b.ReportMetric(float64(now.Microseconds())/float64(b.N), "indexed-µs/event")
	b.ReportMetric(float64(base)/float64(now), "speedup")
}
