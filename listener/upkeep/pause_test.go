package upkeep_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/upkeep"
)

// pauseRequest is one pause the purger started: how long it asked for, and the channel that ends
// it (the test sends on it; a purger that does not wait never receives).
type pauseRequest struct {
	d    time.Duration
	fire chan time.Time
}

// pausingRunner purges 2 rows per batch and pauses between batches on a timer the test controls:
// every pause it starts arrives on the returned channel.
func pausingRunner(t *testing.T, url string, pause time.Duration) (*upkeep.Upkeep, <-chan pauseRequest) {
	u := upkeep.New(upkeep.Config{DatabaseURL: url, InstanceID: "pause", Batch: 2, Pause: pause,
		Grace: 5 * time.Minute, ReminderKeep: 7 * 24 * time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(u.Close)
	requests, over := make(chan pauseRequest), make(chan struct{})
	t.Cleanup(func() { close(over) }) // a failed test leaves no purger blocked in a pause
	upkeep.SetTimer(u, func(d time.Duration) (<-chan time.Time, func() bool) {
		r := pauseRequest{d: d, fire: make(chan time.Time)}
		select {
		case requests <- r:
			return r.fire, func() bool { return true }
		case <-over:
			close(r.fire)
			return r.fire, func() bool { return true }
		}
	})
	return u, requests
}

func expiredEvents(t *testing.T, pool *pgxpool.Pool, n int) {
	now := time.Now().Unix()
	for i := 0; i < n; i++ {
		insert(t, pool, row{kind: 1, created: now - 1000, expires: ptr(now - 1000)})
	}
}

// The purger waits BUZZ_UPKEEP_PAUSE between two full batches, and starts the next batch only
// once the pause has ended: 5 expired rows in batches of 2 make two pauses (after the first and
// the second batch) and none after the short third. Barriers, not sleeps: the test holds each
// pause open, sees that no further batch ran meanwhile, then ends it.
func TestUpkeepPausesBetweenBatches(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	expiredEvents(t, pool, 5)
	const pause = 250 * time.Millisecond
	u, requests := pausingRunner(t, url, pause)

	var leader bool
	var err error
	done := testenv.Async(func() { leader, err = u.RunOnce(context.Background()) })
	for i, left := range []int{3, 1} {
		var r pauseRequest
		select {
		case r = <-requests:
		case <-done:
			t.Fatalf("the pass ended without pause %d (leader=%v err=%v)", i+1, leader, err)
		}
		if r.d != pause {
			t.Errorf("pause %d lasts %s, want BUZZ_UPKEEP_PAUSE %s", i+1, r.d, pause)
		}
		// The purger is inside the pause now, so exactly the batches before it have run.
		if n := testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.events`); n != left {
			t.Errorf("during pause %d: %d rows left, want %d (a batch ran during the pause)", i+1, n, left)
		}
		select {
		case r.fire <- time.Now():
		case <-requests:
			t.Fatalf("pause %d: the next batch ran and paused again before this pause ended", i+1)
		case <-done:
			t.Fatalf("pause %d: the pass went on to its end before this pause ended", i+1)
		}
	}
	select {
	case <-done:
	case <-requests:
		t.Fatal("a pause after the short last batch")
	}
	if err != nil || !leader {
		t.Fatalf("pass: leader=%v err=%v", leader, err)
	}
	if n := testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.events`); n != 0 {
		t.Errorf("%d expired rows left after the pass, want 0", n)
	}
}

// A zero pause does not wait: the same 3 batches run back to back without starting a timer.
func TestUpkeepZeroPauseDoesNotWait(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	expiredEvents(t, pool, 5)
	u, requests := pausingRunner(t, url, 0)

	var leader bool
	var err error
	done := testenv.Async(func() { leader, err = u.RunOnce(context.Background()) })
	for running := true; running; {
		select {
		case <-done:
			running = false
		case r := <-requests:
			t.Errorf("a zero pause started a %s timer", r.d)
			close(r.fire) // let the pass go on; the test has failed already
		}
	}
	if err != nil || !leader {
		t.Fatalf("pass: leader=%v err=%v", leader, err)
	}
	if n := testenv.MustInt(t, pool, `SELECT count(*)::int FROM buzz.events`); n != 0 {
		t.Errorf("%d expired rows left after the pass, want 0", n)
	}
}
