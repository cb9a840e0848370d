package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A flood of /readyz probes costs a bounded number of database round trips: one check (a ping
// and the schema query) answers every probe of the next second, and probes that come while it
// runs wait for it instead of starting their own.
func TestReadyzFloodCostsOneCheck(t *testing.T) {
	pool, err := db.NewPool(context.Background(), testenv.DB(t), "buzzpg-health-test", 1)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	srv := httptest.NewServer(publicReadyz(newReady(pool, nil).check))
	defer srv.Close()

	before := pool.Stat().AcquireCount()
	var wg sync.WaitGroup
	var bad atomic.Int32
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Get(srv.URL)
			if err != nil || resp.StatusCode != http.StatusOK {
				bad.Add(1)
			}
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	if bad.Load() > 0 {
		t.Fatalf("%d of 50 probes were not answered 200", bad.Load())
	}
	// A check acquires twice (ping, schema query). Two checks allow for a flood that straddles
	// the end of the cached second on a slow machine; one per probe would be 100.
	if n := pool.Stat().AcquireCount() - before; n > 4 {
		t.Fatalf("50 concurrent probes acquired the pool %d times, want at most 4 (two checks)", n)
	}
}

// The cache's rules, without a database: one check per period however many callers; a caller
// that gives up does not cancel the check the others wait for.
func TestCachedCheckRunsOncePerPeriod(t *testing.T) {
	var calls atomic.Int32
	release := make(chan struct{})
	c := newCachedCheck(200*time.Millisecond, func(ctx context.Context) (string, error) {
		calls.Add(1)
		select {
		case <-release:
			return "", nil
		case <-ctx.Done():
			return "database unreachable", ctx.Err()
		}
	})
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	if reason, _ := c.get(gone); reason == "" {
		t.Fatal("a caller whose context ended was told ready before any check finished")
	}
	var wg sync.WaitGroup
	errs := make(chan string, 20)
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if reason, err := c.get(context.Background()); reason != "" || err != nil {
				errs <- reason
			}
		}()
	}
	time.Sleep(50 * time.Millisecond) // let them queue behind the running check
	close(release)
	wg.Wait()
	close(errs)
	for r := range errs {
		t.Fatalf("a waiting caller got %q: the first caller's cancellation reached the check", r)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d checks for 21 callers within one period, want 1", n)
	}
	time.Sleep(250 * time.Millisecond)
	c.get(context.Background())
	if n := calls.Load(); n != 2 {
		t.Fatalf("%d checks after the period ran out, want 2", n)
	}
}

// From the moment shutdown begins /readyz answers 503 "shutting down", even while a cached
// database check still says ready.
func TestReadyzSaysShuttingDown(t *testing.T) {
	r := &ready{db: newCachedCheck(time.Minute, func(context.Context) (string, error) { return "", nil })}
	srv := httptest.NewServer(publicReadyz(r.check))
	defer srv.Close()
	probe := func() (int, string) {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b))
	}
	if code, body := probe(); code != http.StatusOK {
		t.Fatalf("before shutdown: %d %q", code, body)
	}
	r.closing.Store(true)
	if code, body := probe(); code != http.StatusServiceUnavailable || body != "shutting down" {
		t.Fatalf("during shutdown: %d %q, want 503 \"shutting down\"", code, body)
	}
}
