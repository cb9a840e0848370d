// Package hooks gives tests a way to stop a process at a named point and let it go again, so
// concurrency tests drive interleavings with barriers instead of sleeps.
//
// In-process: hooks.Set("publish.fenced", fn) makes every At(ctx, "publish.fenced") call fn.
// Cross-process (binary built with -tags testhooks): when BUZZ_HOOKS lists the name, At writes
// $BUZZ_HOOK_DIR/<name>.reached and waits until $BUZZ_HOOK_DIR/<name>.release exists (or ctx ends);
// the test waits for the one and writes the other with Wait and Release.
// Production builds carry only the in-process map lookup.
package hooks

import (
	"context"
	"sync"
)

var (
	mu    sync.RWMutex
	funcs = map[string]func(ctx context.Context){}
	armed bool
)

// Set installs fn at point name (nil removes it) and returns a func that removes it.
func Set(name string, fn func(ctx context.Context)) (remove func()) {
	mu.Lock()
	defer mu.Unlock()
	if fn == nil {
		delete(funcs, name)
	} else {
		funcs[name] = fn
	}
	armed = len(funcs) > 0
	return func() { Set(name, nil) }
}

// At is a named pause point.
func At(ctx context.Context, name string) {
	mu.RLock()
	fn, on := funcs[name], armed
	mu.RUnlock()
	if on && fn != nil {
		fn(ctx)
	}
	crossProcess(ctx, name)
}
