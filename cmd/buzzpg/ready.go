package main

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/listener/fanout"
)

// readyEvery is how long one database check answers /readyz. The public /readyz is open to
// anyone: without it every hit would cost a ping and a schema query.
const readyEvery = time.Second

// readyCheckTimeout bounds one database check: past it the database counts as unreachable.
const readyCheckTimeout = 2 * time.Second

// ready is what /readyz answers, on the public listener and on the operator's one.
type ready struct {
	db      *cachedCheck   // ping + schema, shared by every probe
	fanout  *fanout.Fanout // nil without the relay
	closing atomic.Bool    // set as shutdown begins
}

// newReady checks the database on pool, which should be the process's own small health pool:
// a saturated acceptance pool makes requests wait, it does not make PostgreSQL unreachable.
func newReady(pool *pgxpool.Pool, fanout *fanout.Fanout) *ready {
	return &ready{
		db:     newCachedCheck(readyEvery, func(ctx context.Context) (string, error) { return dbReadiness(ctx, pool) }),
		fanout: fanout,
	}
}

// check returns what keeps the process from being ready ("" when ready) and, where there is
// one, the error behind it. Shutting down and the replication stream are answered from memory,
// at once: a draining process must leave its balancer's rotation without waiting out a cached
// "ready", and a process that just attached need not wait out a cached result.
func (r *ready) check(ctx context.Context) (string, error) {
	if r.closing.Load() {
		return "shutting down", nil
	}
	if reason, err := r.db.get(ctx); reason != "" {
		return reason, err
	}
	if r.fanout != nil && !r.fanout.Ready() {
		return "replication stream not attached", nil
	}
	return "", nil
}

// dbReadiness is the database half of readiness: reachable, and a schema this binary can serve.
func dbReadiness(ctx context.Context, pool *pgxpool.Pool) (string, error) {
	if err := pool.Ping(ctx); err != nil {
		return "database unreachable", err
	}
	if err := checkSchema(ctx, pool); err != nil {
		return "schema not current", err
	}
	return "", nil
}

// publicReadyz says what is wrong, not why: a database error names hosts and users.
func publicReadyz(check func(context.Context) (string, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if reason, _ := check(r.Context()); reason != "" {
			http.Error(w, reason, http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	}
}

// cachedCheck runs check at most once per every, however many callers ask: callers within every
// of the last result get it, and callers that come while a check runs wait for that one
// (singleflight) instead of starting their own. A flood of probes thus costs at most one check
// per second plus its duration.
type cachedCheck struct {
	every time.Duration
	check func(context.Context) (string, error)

	mu      sync.Mutex
	at      time.Time // when the last result was taken; zero before the first
	reason  string
	err     error
	running chan struct{} // closed when the check under way ends; nil when none runs
}

func newCachedCheck(every time.Duration, check func(context.Context) (string, error)) *cachedCheck {
	return &cachedCheck{every: every, check: check}
}

func (c *cachedCheck) get(ctx context.Context) (string, error) {
	c.mu.Lock()
	if !c.at.IsZero() && time.Since(c.at) < c.every {
		defer c.mu.Unlock()
		return c.reason, c.err
	}
	done := c.running
	if done == nil {
		done = make(chan struct{})
		c.running = done
		go c.run(done)
	}
	c.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return "readiness check not finished", ctx.Err() // the prober gave up; nobody reads this
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reason, c.err
}

// run takes one result. Its context is its own: the prober that started it may go away, and the
// others waiting for it must not get that prober's cancellation as the database's answer.
func (c *cachedCheck) run(done chan struct{}) {
	ctx, cancel := context.WithTimeout(context.Background(), readyCheckTimeout)
	defer cancel()
	reason, err := c.check(ctx)
	c.mu.Lock()
	c.reason, c.err, c.at, c.running = reason, err, time.Now(), nil
	c.mu.Unlock()
	close(done)
}
