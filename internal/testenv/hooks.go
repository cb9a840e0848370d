package testenv

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// WaitHook blocks until a process built with -tags testhooks reached hook name in dir.
// It polls for the marker file the process writes; the deadline only turns a hang into a failure.
func WaitHook(t testing.TB, dir, name string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(filepath.Join(dir, name+".reached")); err == nil {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("hook %s not reached within %s", name, timeout)
}

// ReleaseHook lets a process waiting at hook name go on.
func ReleaseHook(t testing.TB, dir, name string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name+".release"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
}
