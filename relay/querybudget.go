package relay

import (
	"errors"
	"sync/atomic"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// takeInitial takes n bytes of initial results for this connection: from its share, its client
// IP's share, then the process-wide budget; all of them or none. It returns "" or the bound that
// refused them ("connection", "ip", "budget").
func (c *conn) takeInitial(n int64) string {
	if c.initialHeld.Add(n) > c.s.cfg.InitialResultPerConn {
		c.initialHeld.Add(-n)
		return "connection"
	}
	if !c.s.ipInitial.take(c.ip, n, false) {
		c.initialHeld.Add(-n)
		return "ip"
	}
	if !c.s.initial.take(n) {
		c.s.ipInitial.give(c.ip, n)
		c.initialHeld.Add(-n)
		return "budget"
	}
	return ""
}

// releaseInitial gives back n bytes taken by takeInitial, to every bound that gave them.
func (c *conn) releaseInitial(n int64) {
	c.initialHeld.Add(-n)
	c.s.ipInitial.give(c.ip, n)
	c.s.initial.release(n)
}

// errBudgetSpent: not one row of an answer fit in the process-wide budget or a share of it.
var errBudgetSpent = errors.New("initial result budget spent")

// byteBudget bounds bytes held across connections (initial results waiting to be sent).
type byteBudget struct {
	limit int64
	used  atomic.Int64
}

func (b *byteBudget) take(n int64) bool {
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	metrics.InitialBytes.Add(float64(n))
	return true
}

func (b *byteBudget) release(n int64) {
	if n != 0 {
		b.used.Add(-n)
		metrics.InitialBytes.Sub(float64(n))
	}
}
