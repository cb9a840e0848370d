package relay

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// The kept deliveries stay within their count, bytes and age, oldest dropped first, in order.
func TestRecentStoredBounds(t *testing.T) {
	cf, err := compileFilter(nostr.Filter{Kinds: []int{1}}, filterLimits{maxLimit: 10, defaultLimit: 10})
	if err != nil {
		t.Fatal(err)
	}
	sub := newSubscription(context.Background(), "all", []*compiledFilter{cf})
	defer sub.close()
	delivery := func(i int, content string) evt.Delivery {
		return evt.Delivery{Event: &nostr.Event{ID: strconv.Itoa(i), Kind: 1, Content: content}, Xid: uint32(i + 3)}
	}
	ids := func(ds []evt.Delivery) (first, last string, n int) {
		if len(ds) == 0 {
			return "", "", 0
		}
		return ds[0].Event.ID, ds[len(ds)-1].Event.ID, len(ds)
	}
	now := time.Now()
	var r recentStored
	for i := 0; i < recentMaxEntries+952; i++ {
		r.add(delivery(i, ""), nil, now)
	}
	if first, last, n := ids(takeAll(&r, sub, now)); n != recentMaxEntries || first != "952" || last != strconv.Itoa(recentMaxEntries+951) {
		t.Fatalf("by count: %d kept, %s..%s; want %d, 952..%d", n, first, last, recentMaxEntries, recentMaxEntries+951)
	}

	var big recentStored
	content := strings.Repeat("x", 1<<20) // 1 MiB each: 8 MiB hold fewer than 8
	for i := 0; i < 20; i++ {
		big.add(delivery(i, content), nil, now)
	}
	if _, last, n := ids(takeAll(&big, sub, now)); n >= 8 || n == 0 || last != "19" || big.bytes > recentMaxBytes {
		t.Fatalf("by bytes: %d kept (%d bytes), last %s; want fewer than 8 within %d bytes, the newest last", n, big.bytes, last, recentMaxBytes)
	}

	var aged recentStored
	aged.add(delivery(1, ""), nil, now)
	aged.add(delivery(2, ""), nil, now.Add(recentMaxAge+time.Second))
	if first, _, n := ids(takeAll(&aged, sub, now.Add(recentMaxAge+time.Second))); n != 1 || first != "2" {
		t.Fatalf("by age: %d kept, first %s; want only the new one", n, first)
	}
}

// seesNothing is a snapshot taken before any of the test's transactions (ids below 2^31).
var seesNothing = &mvccSnapshot{}

// takeAll is what a REQ registering at now sends when its query's snapshot saw none of the kept.
func takeAll(r *recentStored, sub *subscription, now time.Time) []evt.Delivery {
	return r.take(sub, now).unseen(seesNothing, sub)
}

// kind1Subscription is a REQ for kind 1 (limit 10), closed when the test ends.
func kind1Subscription(t *testing.T) *subscription {
	t.Helper()
	cf, err := compileFilter(nostr.Filter{Kinds: []int{1}, Limit: 10}, filterLimits{maxLimit: 10, defaultLimit: 10})
	if err != nil {
		t.Fatal(err)
	}
	sub := newSubscription(context.Background(), "k1", []*compiledFilter{cf})
	t.Cleanup(sub.close)
	return sub
}

// A REQ gets the kept entries of its registration, whatever the ring drops while its query runs,
// and of them only those its snapshot did not see and its filters match: the rows answered the
// others.
func TestRecentTakenUnseen(t *testing.T) {
	sub := kind1Subscription(t)
	now := time.Now()
	var r recentStored
	for i := 1; i <= 6; i++ { // xids 101..106; kind 2 for 103
		kind := 1
		if i == 3 {
			kind = 2
		}
		r.add(evt.Delivery{Event: &nostr.Event{ID: strconv.Itoa(i), Kind: kind}, Xid: uint32(100 + i)}, nil, now)
	}
	before := r.take(sub, now)
	for i := 0; i < recentMaxEntries; i++ { // the ring forgets all six while the query runs
		r.add(evt.Delivery{Event: &nostr.Event{ID: "later", Kind: 1}, Xid: 500}, nil, now)
	}
	// The snapshot saw 101, 102 and 104 (103 and 105 in progress, 106 after it).
	snap := &mvccSnapshot{xmin: 103, xmax: 106, xip: []uint64{103, 105}}
	var got []string
	for _, d := range before.unseen(snap, sub) {
		got = append(got, d.Event.ID)
	}
	if strings.Join(got, ",") != "5,6" {
		t.Fatalf("replayed %v; want 5,6 (not seen, kind 1, oldest first)", got)
	}
	if n := len(before.unseen(nil, sub)); n != 0 {
		t.Fatalf("without a snapshot (no query) %d replayed; want none", n)
	}
}

// take drops what aged out, even when no event came since: a REQ after a burst copies nothing.
func TestRecentTakeDropsAged(t *testing.T) {
	sub := kind1Subscription(t)
	now := time.Now()
	var r recentStored
	for i := 0; i < 100; i++ {
		r.add(evt.Delivery{Event: &nostr.Event{ID: strconv.Itoa(i), Kind: 1}, Xid: uint32(i + 3)}, nil, now)
	}
	if got := r.take(sub, now.Add(recentMaxAge+time.Millisecond)); len(got.entries) != 0 || r.n != 0 || r.bytes != 0 {
		t.Fatalf("after the age limit: %d taken, %d kept (%d bytes); want none", len(got.entries), r.n, r.bytes)
	}
}
