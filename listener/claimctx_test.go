package listener

import (
	"context"
	"testing"
	"time"
)

// A claim's context survives its caller's stop for claimGrace, then ends; before a stop it has
// no deadline.
func TestClaimContextOutlivesStopByGrace(t *testing.T) {
	old := claimGrace
	claimGrace = 50 * time.Millisecond
	defer func() { claimGrace = old }()

	parent, stop := context.WithCancel(context.Background())
	ctx, cancel := claimContext(parent)
	defer cancel()
	if _, ok := ctx.Deadline(); ok {
		t.Fatal("a claim has a deadline before any stop")
	}
	stop()
	if ctx.Err() != nil {
		t.Fatal("the claim was cancelled with its caller")
	}
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the claim outlived its grace")
	}

	// Finished normally: releasing it ends it at once and leaves no timer behind to matter.
	parent2, stop2 := context.WithCancel(context.Background())
	defer stop2()
	ctx2, cancel2 := claimContext(parent2)
	cancel2()
	if ctx2.Err() == nil {
		t.Fatal("cancel did not end the claim context")
	}
}
