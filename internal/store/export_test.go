package store

// Test access for store_test (an in-package test would import testenv, which imports store).

// SetOnBatch installs onBatch with each call's size (call before the first Accept).
func (b *Batcher) SetOnBatch(fn func(n int)) { b.onBatch = func(keys []string) { fn(len(keys)) } }

// SetOnBatchKeys installs onBatch with each call's lock keys, in the call's order.
func (b *Batcher) SetOnBatchKeys(fn func(keys []string)) { b.onBatch = fn }

// Queued is the number of events waiting for a call.
func (b *Batcher) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, p := range b.queue {
		n += len(p.raws)
	}
	return n
}

// Running is the number of calls in flight.
func (b *Batcher) Running() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.running
}

// ClientSQLStates lists every SQLSTATE the relay answers as a client error.
func ClientSQLStates() []string {
	var out []string
	for c := range sqlstatePrefix {
		out = append(out, c)
	}
	for c := range sqlstateMessage {
		out = append(out, c)
	}
	return out
}
