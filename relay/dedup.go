package relay

import (
	"sync/atomic"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// dedupBudget bounds the ids all subscriptions' de-duplication windows (subscription.seen) hold
// together. A window starts empty and grows with what it is sent, up to seenPerSub; past the
// budget, a window no longer grows beyond dedupMinWindow ids and forgets its oldest instead. The
// window is what catches an event sent twice that nothing else does (docs/design.md, I-numbered
// guarantees aside: one event fanned out by two processes, or stored again); a smaller one still
// catches the repeats that come close together, which is what they are. Before that, 8,192 busy
// subscriptions from two addresses held about 800 MB (issue 29, finding 5).
type dedupBudget struct {
	limit int64 // ids
	held  atomic.Int64
}

// dedupIDBytes is about what one id costs in a window: 16 bytes in the ring, 16 in the map, and
// the map's overhead (relay/seen_test.go measures 1,024 ids at about 51 KiB).
const dedupIDBytes = 56

// dedupMinWindow ids every window may hold whatever the budget: a subscription's own burst of
// repeats fits.
const dedupMinWindow = 128

func newDedupBudget(bytes int64) *dedupBudget {
	return &dedupBudget{limit: max(1, bytes/dedupIDBytes)}
}

// take charges one more id to a window of size ids; false when the budget is spent and the
// window already holds its minimum.
func (b *dedupBudget) take(size int) bool {
	if b == nil {
		return true
	}
	if size >= dedupMinWindow && b.held.Load() >= b.limit {
		return false
	}
	b.held.Add(1)
	metrics.DedupBytes.Add(dedupIDBytes)
	return true
}

func (b *dedupBudget) give(n int) {
	if b == nil || n == 0 {
		return
	}
	b.held.Add(-int64(n))
	metrics.DedupBytes.Sub(float64(n * dedupIDBytes))
}
