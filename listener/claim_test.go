package listener

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// A claim's context survives its caller's stop for claimGrace, then ends; before a stop it has
// no deadline.
func TestClaimContextOutlivesStopByGrace(t *testing.T) {
	old := claimGrace
	claimGrace = 50 * time.Millisecond
	defer func() { claimGrace = old }()

	parent, stop := context.WithCancel(context.Background())
	ctx, cancel := ClaimContext(parent)
	defer cancel()
	if _, ok := ctx.Deadline(); ok {
		t.Fatal("a claim has a deadline before any stop")
	}
	stopped := time.Now()
	stop()
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the claim outlived its grace")
	}
	if d := time.Since(stopped); d < claimGrace {
		t.Fatalf("the claim ended %s after its caller stopped, before its grace of %s", d, claimGrace)
	}

	// Finished normally: releasing it ends it at once and leaves no timer behind to matter.
	parent2, stop2 := context.WithCancel(context.Background())
	defer stop2()
	ctx2, cancel2 := ClaimContext(parent2)
	cancel2()
	if ctx2.Err() == nil {
		t.Fatal("cancel did not end the claim context")
	}
}

func TestIsServerErrorUsesUnlocalizedSeverity(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Severity: "ERROR", SeverityUnlocalized: "ERROR"}, true},
		{&pgconn.PgError{Severity: "FEHLER", SeverityUnlocalized: "ERROR"}, true}, // lc_messages = de_DE
		{&pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL"}, false},
		{&pgconn.PgError{Severity: "SCHWER", SeverityUnlocalized: "FATAL"}, false},
		{fmt.Errorf("confirm: %w", &pgconn.PgError{Severity: "ERROR"}), true}, // before 9.6
		{errors.New("connection reset"), false},
	} {
		if got := IsServerError(c.err); got != c.want {
			t.Errorf("IsServerError(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
