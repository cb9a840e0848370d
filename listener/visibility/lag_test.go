package visibility

import (
	"context"
	"testing"
)

// A viewer whose publication left a newer change pending is pending since that change, not since
// its outbox row was first made (sql/0003_visibility). The row's start is moved an hour back to stand for a
// viewer that has been changing for an hour; the change still pending is seconds old.
func TestLagCountsFromTheChangeStillPending(t *testing.T) {
	e := newEnv(t)
	viewer, channel := e.hiddenViewer()
	e.exec(`UPDATE buzz.visibility_outbox SET enqueued_at = now() - interval '1 hour' WHERE viewer = $1`, viewer)
	_, g, done := e.pausedPublisher("a", viewer) // has read the hide's generation
	e.unhide(viewer, channel)                    // a newer generation, pending behind it
	g.Open()
	if r := <-done; r.err != nil || r.out != "published" {
		t.Fatalf("publication of the older generation: %q %v, want published", r.out, r.err)
	}
	var pending int64
	var oldest float64
	if err := e.pool.QueryRow(context.Background(),
		`SELECT pending_viewers, oldest_pending_seconds FROM buzz.visibility_lag()`).Scan(&pending, &oldest); err != nil {
		t.Fatal(err)
	}
	if pending != 1 || oldest > 600 {
		t.Fatalf("visibility_lag: %d pending, oldest %.0f s; want 1, pending since the unhide (seconds ago), not the hour-old row", pending, oldest)
	}
}
