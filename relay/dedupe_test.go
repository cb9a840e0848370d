package relay

import (
	"context"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestIDFIFOGrowKeepsKeysAndOrder(t *testing.T) {
	f := newIDFIFO[int](3)
	for k := 1; k <= 5; k++ { // 1, 2 evicted; ring wrapped
		f.add(k)
	}
	f.grow(5)
	for _, k := range []int{3, 4, 5} {
		if !f.has(k) {
			t.Fatalf("lost %d on grow", k)
		}
	}
	f.add(6)
	f.add(7) // fills the new capacity
	f.add(8) // evicts the oldest: 3
	if f.has(3) || !f.has(4) || !f.has(8) {
		t.Fatalf("after grow the oldest key must go first: has(3)=%v has(4)=%v has(8)=%v", f.has(3), f.has(4), f.has(8))
	}
}

// storeRows inserts n public kind-1 rows of pk straight into buzz.events (the relay serves rows as
// stored), received ago, and returns them newest first.
func storeRows(t *testing.T, tr *testRelay, pk string, n int, ago time.Duration) []nostr.Event {
	t.Helper()
	base := int64(nostr.Now()) - int64(n) - 10
	rows, err := tr.pool.Query(context.Background(), `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, received_at)
		SELECT md5($1 || i) || md5(i || $1), $1, $2 + i, 1, '[]', 'row ' || i, repeat('0', 128), now() - $4::interval
		  FROM generate_series(1, $3) i
		RETURNING id, created_at`, pk, base, n, ago.String())
	if err != nil {
		t.Fatal(err)
	}
	var out []nostr.Event
	for rows.Next() {
		var ev nostr.Event
		var at int64
		if err := rows.Scan(&ev.ID, &at); err != nil {
			t.Fatal(err)
		}
		ev.PubKey, ev.CreatedAt, ev.Kind, ev.Tags = pk, nostr.Timestamp(at), 1, nostr.Tags{}
		out = append([]nostr.Event{ev}, out...)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Sent at most once per subscription: an initial answer with more recent rows than the live
// de-dup set holds still remembers its newest rows (sent, and remembered, first), so the newest
// arriving live afterwards (replication catching up) is not sent again.
func TestLargeRecentAnswerNotResentLive(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs := storeRows(t, tr, pk, seenPerSub+200, 0)
	c := tr.dial(t)
	got := c.req("big", nostr.Filter{Authors: []string{pk}, Limit: len(evs)})
	if len(got) != len(evs) {
		t.Fatalf("initial answer has %d rows, want %d", len(got), len(evs))
	}
	newest := evs[0]
	tr.s.Deliver(publicDelivery(&newest))
	syncNone(t, c, "big")
}

// The same when replication runs further behind than the fixed window: a row that arrived 10
// minutes ago may still come live while the stream is 8 minutes behind.
func TestRecentWindowFollowsReplicationLag(t *testing.T) {
	tr := startRelay(t, nil)
	tr.s.SetReplicationLag(func() time.Duration { return 8 * time.Minute })
	_, pk := testenv.NewKey()
	evs := storeRows(t, tr, pk, 3, 10*time.Minute)
	c := tr.dial(t)
	if got := c.req("lagged", nostr.Filter{Authors: []string{pk}}); len(got) != 3 {
		t.Fatalf("initial answer has %d rows, want 3", len(got))
	}
	for i := range evs {
		tr.s.Deliver(publicDelivery(&evs[i]))
	}
	syncNone(t, c, "lagged")
}

// The de-dup set of a subscription stays bounded however large the recent answer: at most
// MaxLimit of its newest rows are remembered beside the live window, and those newest rows are
// not sent again when they arrive live.
func TestRecentAnswerMemoryIsBounded(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.MaxLimit, c.DefaultLimit = 100, 100 })
	_, pk := testenv.NewKey()
	evs := storeRows(t, tr, pk, 300, 0)
	c := tr.dial(t)
	// Two filters of 100 rows each, disjoint: 200 recent rows in the answer.
	got := c.req("two", nostr.Filter{Authors: []string{pk}, Limit: 100},
		nostr.Filter{Authors: []string{pk}, Until: &evs[100].CreatedAt, Limit: 100})
	if len(got) != 200 {
		t.Fatalf("answer has %d rows, want 200", len(got))
	}
	var capacity int
	for _, sc := range tr.s.snapshotConns() {
		sc.mu.Lock()
		if sub := sc.subs["two"]; sub != nil {
			sub.mu.Lock()
			capacity = sub.seen.cap
			sub.mu.Unlock()
		}
		sc.mu.Unlock()
	}
	if capacity != seenPerSub+100 {
		t.Fatalf("de-dup capacity %d, want seenPerSub + MaxLimit = %d", capacity, seenPerSub+100)
	}
	newest := evs[0]
	tr.s.Deliver(publicDelivery(&newest))
	syncNone(t, c, "two")
}
