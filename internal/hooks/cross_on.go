//go:build testhooks

package hooks

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"
)

// Enabled reports whether this binary carries cross-process hooks.
const Enabled = true

func crossProcess(ctx context.Context, name string) {
	list := os.Getenv("BUZZ_HOOKS")
	dir := os.Getenv("BUZZ_HOOK_DIR")
	if list == "" || dir == "" {
		return
	}
	hit := false
	for _, n := range strings.Split(list, ",") {
		if strings.TrimSpace(n) == name {
			hit = true
		}
	}
	if !hit {
		return
	}
	_ = os.WriteFile(reachedFile(dir, name), []byte(fmt.Sprint(os.Getpid())), 0o644)
	release := releaseFile(dir, name)
	// A barrier, not a timing guess: the test decides when this process may go on.
	t := time.NewTicker(2 * time.Millisecond)
	defer t.Stop()
	for {
		if _, err := os.Stat(release); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
