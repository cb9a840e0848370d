package hooks

import (
	"os"
	"path/filepath"
	"time"
)

// The test's side of a cross-process pause point: the process writes reachedFile and waits for
// releaseFile (cross_on.go); the test waits for the one and writes the other.

func reachedFile(dir, name string) string { return filepath.Join(dir, name+".reached") }
func releaseFile(dir, name string) string { return filepath.Join(dir, name+".release") }

// TB is the part of testing.TB that Wait and Release use (this package must not import testing).
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Wait blocks until a process built with -tags testhooks reached point name in dir. It polls
// for the marker file the process writes; the deadline only turns a hang into a failure.
func Wait(t TB, dir, name string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if _, err := os.Stat(reachedFile(dir, name)); err == nil {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("hook %s not reached within %s", name, timeout)
}

// Release lets a process waiting at point name in dir go on.
func Release(t TB, dir, name string) {
	t.Helper()
	if err := os.WriteFile(releaseFile(dir, name), nil, 0o644); err != nil {
		t.Fatalf("release hook %s: %v", name, err)
	}
}
