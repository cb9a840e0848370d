package tests

// Upkeep against a real `buzzpg serve` (listener/upkeep, sql/0007_upkeep.up.sql): purges do not
// reach subscribers.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Deletes do not wake subscribers: the publication stays insert-only, and a subscriber that saw
// events live sees nothing when upkeep removes them (an expired event and events of a retention
// rule), only the next insert, once.
func TestUpkeepDeletesDoNotReachSubscribers(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	var ins, upd, del, trunc bool
	testenv.MustScan(t, pool.QueryRow(ctx, `SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = 'buzz_events'`),
		&ins, &upd, &del, &trunc)
	if !ins || upd || del || trunc {
		t.Fatalf("publication buzz_events publishes insert=%v update=%v delete=%v truncate=%v, want inserts only", ins, upd, del, trunc)
	}
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url, Env: map[string]string{
		"BUZZ_UPKEEP_INTERVAL": "100ms", "BUZZ_UPKEEP_GRACE": "0s", "BUZZ_UPKEEP_BATCH": "2"}})
	author := testenv.NewUser()
	sub := testenv.Dial(t, r.URL).Subscribe(nostr.Filter{Authors: []string{author.PK}})
	pub := testenv.Dial(t, r.URL)

	old := nostr.Timestamp(time.Now().Unix() - 3600)
	var ids []string
	for i := 0; i < 3; i++ {
		ev := author.EventAt(t, 1, nil, fmt.Sprint("old ", i), old+nostr.Timestamp(i))
		pub.MustPublish(ev)
		ids = append(ids, ev.ID)
	}
	exp := author.Event(t, 7, nostr.Tags{{"expiration", fmt.Sprint(time.Now().Unix() + 2)}}, "+")
	pub.MustPublish(exp)
	ids = append(ids, exp.ID)
	sub.WaitEvents(20*time.Second, ids...)

	if _, err := pool.Exec(ctx, `INSERT INTO buzz.retention (name, kinds, max_age) VALUES ('notes', '{1}', '30 minutes')`); err != nil {
		t.Fatal(err)
	}
	testenv.WaitUntil(t, 30*time.Second, "upkeep to remove the old and the expired events", func() bool {
		return testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.events WHERE pubkey = $1`, author.PK) == 0
	})
	// Fan-out follows commit order: had the deletes been streamed, they would arrive before this.
	marker := author.Event(t, 1, nil, "after the purge")
	pub.MustPublish(marker)
	sub.WaitEvents(20*time.Second, marker.ID)
	counts := sub.Counts()
	for _, id := range append(ids, marker.ID) {
		if counts[id] != 1 {
			t.Errorf("event %s delivered %d times, want once", id[:8], counts[id])
		}
	}
	if len(counts) != len(ids)+1 {
		t.Errorf("subscriber saw %d distinct events, want %d", len(counts), len(ids)+1)
	}
	var removed int64
	testenv.MustScan(t, pool.QueryRow(ctx, `SELECT coalesce(sum(removed_total), 0)::bigint FROM buzz.upkeep_status()`), &removed)
	if removed != int64(len(ids)) {
		t.Errorf("upkeep_status counts %d rows removed, want %d", removed, len(ids))
	}
}
