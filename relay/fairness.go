package relay

import (
	"context"
	"sync"
)

// ipQueries bounds the REQ/COUNT queries (and their gates' member lookups) in flight per client
// (limitKey) across its connections.
// The per-connection bound alone let two connections of one client hold the whole query pool with
// slow queries, and every other client's reads then timed out waiting for a connection. A client
// over its share waits, like one over its per-connection bound: its reads stop, nothing fails.
type ipQueries struct {
	mu    sync.Mutex
	limit int
	sems  map[string]*ipSem
}

type ipSem struct {
	slots chan struct{}
	refs  int // acquirers holding or waiting for a slot; the entry goes when none is left
}

func newIPQueries(limit int) *ipQueries {
	return &ipQueries{limit: max(1, limit), sems: map[string]*ipSem{}}
}

func (q *ipQueries) acquire(ctx context.Context, ip string) bool {
	q.mu.Lock()
	s := q.sems[ip]
	if s == nil {
		s = &ipSem{slots: make(chan struct{}, q.limit)}
		q.sems[ip] = s
	}
	s.refs++
	q.mu.Unlock()
	select {
	case s.slots <- struct{}{}:
		return true
	case <-ctx.Done():
		q.unref(ip, s)
		return false
	}
}

func (q *ipQueries) release(ip string) {
	q.mu.Lock()
	s := q.sems[ip]
	q.mu.Unlock()
	<-s.slots
	q.unref(ip, s)
}

func (q *ipQueries) unref(ip string, s *ipSem) {
	q.mu.Lock()
	if s.refs--; s.refs == 0 {
		delete(q.sems, ip)
	}
	q.mu.Unlock()
}
