package testenv

import (
	"testing"
	"time"
)

// WaitUntil polls cond until it holds, for state with no event to wait on (rows, logs, flags).
// The deadline only turns a hang into a failure; it is not a timing assumption.
func WaitUntil(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for: %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
