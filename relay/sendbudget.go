package relay

import (
	"sync"
	"sync/atomic"
)

// sendBudget bounds the bytes waiting in send queues across connections: all of the process's
// together (SendBudget), and one client's (limitKey) together (SendClientShare). Each queue has
// its own bound (SendQueueBytes), but alone that lets MaxConns readers that read nothing hold
// MaxConns × SendQueueBytes (40 GiB with the defaults), and one client opening MaxConnsPerIP
// connections that all subscribe to everything and never read 4 GiB, fed by its own rate-limited
// EVENTs: memory, and so every other client, would be the slow readers' to decide.
//
// The shared bounds follow the rule of the queue's own: a queue that holds nothing always takes
// a message (its reader is not behind), a queue that holds something is refused when the message
// would take its client, or the process, past the bound, and the live push that is refused closes
// the connection as a slow client (conn.overflow). A reader that keeps up keeps its queue empty
// between writes and is not closed by someone else's backlog. Concurrent pushes each check the
// counts before adding to them, so the bounds can be passed by what pushes in flight at once add.
// Initial REQ results are counted too (they are bytes in the same queues) but not refused here:
// the initial-result budget admits them (InitialResultBudget), and they fill a queue only to half.
type sendBudget struct {
	limit, perClient int64
	total            atomic.Int64

	mu      sync.Mutex
	clients map[string]*clientQueued
}

// clientQueued is what one client's queues hold together.
type clientQueued struct {
	bytes atomic.Int64
	refs  int // the client's queues that joined and have not left (under sendBudget.mu)
}

func newSendBudget(limit, perClient int64) *sendBudget {
	return &sendBudget{limit: limit, perClient: perClient, clients: map[string]*clientQueued{}}
}

// join makes q count against the budget and key's share of it, until q.release.
func (b *sendBudget) join(q *sendQueue, key string) {
	b.mu.Lock()
	cq := b.clients[key]
	if cq == nil {
		cq = &clientQueued{}
		b.clients[key] = cq
	}
	cq.refs++
	b.mu.Unlock()
	q.mu.Lock()
	q.budget, q.client, q.clientKey = b, cq, key
	q.mu.Unlock()
}

func (b *sendBudget) leave(key string, cq *clientQueued) {
	b.mu.Lock()
	if cq.refs--; cq.refs == 0 {
		delete(b.clients, key)
	}
	b.mu.Unlock()
}

// add changes the counts by n bytes (negative: they left a queue).
func (b *sendBudget) add(cq *clientQueued, n int) {
	b.total.Add(int64(n))
	cq.bytes.Add(int64(n))
}

// refuses says which shared bound n more bytes of cq's client would pass: "client", "budget" or "".
func (b *sendBudget) refuses(cq *clientQueued, n int) string {
	switch {
	case cq.bytes.Load()+int64(n) > b.perClient:
		return "client"
	case b.total.Load()+int64(n) > b.limit:
		return "budget"
	}
	return ""
}
