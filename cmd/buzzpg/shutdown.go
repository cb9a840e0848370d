package main

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/relay"
)

// hookShutdownBegun is where a test holds a process that has begun its shutdown.
const hookShutdownBegun = "serve.shutdown_begun"

// A graceful shutdown must end before the orchestrator's patience does (Kubernetes sends SIGKILL
// 30 s after SIGTERM by default): killed, the process leaves its claims to wait out their leases
// and its slot to be reaped a minute later, the very things the shutdown is for. So every step
// waits for at most its own grace, and those that can run together do:
//
//	client drain            BUZZ_SHUTDOWN_GRACE, then relay.KillWait for closed connections
//	components stop         componentStopGrace
//	releases, side by side  releaseGrace   (snapshot claims, reminder claims, slot and instance row)
//	pools close, together   poolCloseGrace
//
// The worst case, a database that stopped answering, is their sum, shutdownBound: 27 s with the
// defaults. The releases each keep a grace of their own, starting once the components stopped,
// so a long drain or a claim finishing under its grace (listener/claimctx.go) does not cost them;
// run one after another they used to add 15 s, and the pools, closed one by one, up to 25 s more.
const (
	componentStopGrace = 10 * time.Second
	releaseGrace       = 5 * time.Second
	// Closing a pool at exit saves nothing the exit does not: PostgreSQL ends a backend whose
	// socket closes and rolls back what it had open. Its wait is for connections a stuck component
	// still holds, and for pgx's cancel request of a query cut short (up to 15 s per connection on
	// a database that does not answer): a second is plenty for a database that does.
	poolCloseGrace = time.Second
)

// shutdownBound is the longest a graceful shutdown can take with the given client drain grace.
func shutdownBound(drain time.Duration) time.Duration {
	return drain + relay.KillWait + componentStopGrace + releaseGrace + poolCloseGrace
}

// releaseStep gives back what one component holds in the database once it has stopped.
type releaseStep struct {
	name  string
	close func(context.Context) error
}

// release runs the steps side by side, each under a context of its own that ends releaseGrace
// from now, and returns when they all have, or at releaseGrace: a step that overstays its
// context is left running. They need not wait for one another: each touches only its own rows
// (or slot), and the listener pool has connections for all of them (see openPools).
func release(steps []releaseStep, log *slog.Logger) {
	var wg sync.WaitGroup
	for _, s := range steps {
		ctx, cancel := context.WithTimeout(context.Background(), releaseGrace)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer cancel()
			if err := s.close(ctx); err != nil {
				log.Warn(s.name+" close", "err", err)
			}
		}()
	}
	finishedWithin(releaseGrace, wg.Wait)
}

// poolSet is the process's database pools, closed together at exit.
type poolSet struct {
	names []string
	pools []*pgxpool.Pool
}

func (s *poolSet) add(name string, p *pgxpool.Pool) {
	s.names = append(s.names, name)
	s.pools = append(s.pools, p)
}

// close closes every pool at once and waits for at most poolCloseGrace: pgxpool's Close waits
// for every acquired connection, and for connections still being torn down.
func (s *poolSet) close(log *slog.Logger) {
	var mu sync.Mutex
	// Filled before any close starts: a close that ends early deletes under mu while this loop
	// would still be writing.
	open := map[string]bool{}
	for _, n := range s.names {
		open[n] = true
	}
	var wg sync.WaitGroup
	for i, p := range s.pools {
		name := s.names[i]
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.Close()
			mu.Lock()
			delete(open, name)
			mu.Unlock()
		}()
	}
	if finishedWithin(poolCloseGrace, wg.Wait) {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	var left []string
	for _, n := range s.names {
		if open[n] {
			left = append(left, n)
		}
	}
	log.Warn("database pools did not close in time; exiting without them", "pools", left, "waited", poolCloseGrace)
}

// finishedWithin runs fn and reports whether it returned within d; if not, fn goes on alone.
func finishedWithin(d time.Duration, fn func()) bool {
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}
