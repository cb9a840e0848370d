//go:build !testhooks

package hooks

import "context"

func crossProcess(context.Context, string) {}

// Enabled reports whether this binary carries cross-process hooks.
const Enabled = false
