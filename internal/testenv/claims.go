package testenv

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/hooks"
)

// ClaimBreak is how a claim statement breaks off after its first row reached us (the connection
// is cut there).
type ClaimBreak int

const (
	// BreakCommitted: the claim committed before its rows were sent: PostgreSQL sends a small
	// result after the commit. The common case.
	BreakCommitted ClaimBreak = iota
	// BreakCommitsLater: the rows were sent before the commit (a large result, or a NOTICE,
	// flushes them), and the claim commits after the break: the server has not noticed its client
	// is gone, and the cancel request pgx sends for a broken connection is lost with the network.
	BreakCommitsLater
	// BreakAborts: as before, but pgx's cancel request arrives and the claim fails in its commit:
	// the undo must change nothing.
	BreakAborts
)

// claimBreaks names every ClaimBreak, for subtests.
var claimBreaks = []struct {
	name string
	mode ClaimBreak
}{{"committed", BreakCommitted}, {"commits_after_the_break", BreakCommitsLater}, {"never_commits", BreakAborts}}

// ForEachClaimBreak runs test once for every ClaimBreak, each as a subtest named for it.
func ForEachClaimBreak(t *testing.T, test func(*testing.T, ClaimBreak)) {
	for _, bc := range claimBreaks {
		t.Run(bc.name, func(t *testing.T) { test(t, bc.mode) })
	}
}

// Gate is an in-process barrier at a hook point: the first pass that only accepts stops there
// until Open (or its context ends); later passes go through.
type Gate struct {
	reached, release chan struct{}
	once, opened     sync.Once
}

// PauseAt installs a Gate at hook point name for the passes only accepts (all of them when only
// is nil); the test's cleanup removes it.
func PauseAt(t testing.TB, name string, only func(ctx context.Context) bool) *Gate {
	g := &Gate{reached: make(chan struct{}), release: make(chan struct{})}
	remove := hooks.Set(name, func(ctx context.Context) {
		if only != nil && !only(ctx) {
			return
		}
		first := false
		g.once.Do(func() { first = true; close(g.reached) })
		if !first {
			return
		}
		select {
		case <-g.release:
		case <-ctx.Done():
		}
	})
	t.Cleanup(remove)
	return g
}

// Wait returns once a pass stopped at the gate.
func (g *Gate) Wait(t testing.TB) {
	t.Helper()
	select {
	case <-g.reached:
	case <-time.After(30 * time.Second):
		t.Fatal("hook not reached")
	}
}

// Reached reports whether a pass stopped at the gate.
func (g *Gate) Reached() bool {
	select {
	case <-g.reached:
		return true
	default:
		return false
	}
}

// Open lets the held pass (and every later one) go on; it may be called more than once.
func (g *Gate) Open() { g.opened.Do(func() { close(g.release) }) }

// OpenAtCleanup opens g at the latest when the test ends (before what was registered earlier
// stops the component held there) and returns Open.
func (g *Gate) OpenAtCleanup(t testing.TB) func() {
	t.Cleanup(g.Open)
	return g.Open
}

// WaitCut waits until a statement reached c's cut.
func WaitCut(t testing.TB, c *RowCut) {
	t.Helper()
	select {
	case <-c.Cut():
	case <-time.After(10 * time.Second):
		t.Fatal("no claim reached the cut")
	}
}

// WaitingForRowLock reports whether a backend other than a claim blocked on an advisory lock
// waits for a row lock (an undo waiting for the claim to end).
func WaitingForRowLock(t testing.TB, q Querier) bool {
	return MustInt(t, q, `SELECT count(*) FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid()
		  AND wait_event_type = 'Lock' AND wait_event <> 'advisory' AND query LIKE '%FOR SHARE%'`) > 0
}

// RunStoppable runs run in the background; cancel stops it, stopped waits until it returned nil.
func RunStoppable(t testing.TB, run func(context.Context) error) (cancel context.CancelFunc, stopped func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(cancel)
	return cancel, func() {
		t.Helper()
		select {
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("did not stop")
		}
	}
}

// CloseWithin calls close with a 10 s deadline; an error fails the test.
func CloseWithin(t testing.TB, close func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := close(ctx); err != nil {
		t.Fatal(err)
	}
}
