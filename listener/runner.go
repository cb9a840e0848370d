package listener

import (
	"context"
	"sync"
)

// Runner is the start and stop of a component's Run: Run starts once, and Close cancels a running
// Run and waits for it to return. The zero value is ready to use.
type Runner struct {
	mu     sync.Mutex
	closed bool
	cancel context.CancelFunc
	done   chan struct{}
}

// Start begins a Run: the context it returns ends when Stop is called, and finish, deferred by
// Run, tells Stop that Run returned. ok is false, and Run must not go on, when Run was started
// before or Stop was called.
func (r *Runner) Start(ctx context.Context) (rctx context.Context, finish func(), ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || r.done != nil {
		return nil, nil, false
	}
	rctx, cancel := context.WithCancel(ctx)
	r.cancel, r.done = cancel, make(chan struct{})
	done := r.done
	return rctx, func() { cancel(); close(done) }, true
}

// Stop refuses every later Start and stops a running Run: it cancels Run's context and waits
// until Run returned or ctx ended (then it returns ctx's error).
func (r *Runner) Stop(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	cancel, done := r.cancel, r.done
	r.mu.Unlock()
	if cancel == nil {
		return nil
	}
	cancel()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
