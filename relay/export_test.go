package relay

// Accessors for tests only: what they read has no use in the relay itself.

// empty reports whether no filter is counted: every subscription that ended was taken out.
func (in *interest) empty() bool {
	in.mu.RLock()
	defer in.mu.RUnlock()
	return len(in.anyKind) == 0 && len(in.byKind) == 0 && len(in.byH) == 0 && len(in.byID) == 0 && len(in.byAuthor) == 0
}

// currentEpoch is the count of forgets so far: a lookup that read at this epoch may cache what it
// read until the next forget (put).
func (mc *memberCache) currentEpoch() uint64 {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.epoch
}
