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
	if first, last, n := ids(r.matching(sub, now)); n != recentMaxEntries || first != "952" || last != strconv.Itoa(recentMaxEntries+951) {
		t.Fatalf("by count: %d kept, %s..%s; want %d, 952..%d", n, first, last, recentMaxEntries, recentMaxEntries+951)
	}

	var big recentStored
	content := strings.Repeat("x", 1<<20) // 1 MiB each: 8 MiB hold fewer than 8
	for i := 0; i < 20; i++ {
		big.add(delivery(i, content), nil, now)
	}
	if _, last, n := ids(big.matching(sub, now)); n >= 8 || n == 0 || last != "19" || big.bytes > recentMaxBytes {
		t.Fatalf("by bytes: %d kept (%d bytes), last %s; want fewer than 8 within %d bytes, the newest last", n, big.bytes, last, recentMaxBytes)
	}

	var aged recentStored
	aged.add(delivery(1, ""), nil, now)
	aged.add(delivery(2, ""), nil, now.Add(recentMaxAge+time.Second))
	if first, _, n := ids(aged.matching(sub, now.Add(recentMaxAge+time.Second))); n != 1 || first != "2" {
		t.Fatalf("by age: %d kept, first %s; want only the new one", n, first)
	}
}
