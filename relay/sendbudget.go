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
// The shared bounds apply to queues that hold a backlog (more than sharedFloor: a reader that keeps
// up holds less, a batch in flight and a burst behind it): such a queue's live push that would
// take its client, or the process, past the bound is refused, and the connection closed as a slow
// client (conn.overflow). Initial REQ results that would pass a bound wait for room in their queue
// instead (pushHalf), as they wait for its half. Replies to a client's own messages (push) are held
// to the queue's own bound only. What the budget bounds is then the backlogs: every queue may
// still hold up to sharedFloor, or one message when empty, beyond it, and concurrent pushes each
// check the counts before adding to them, so the bounds can be passed by what they add at once.
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

// sharedFloor is what a queue may hold without being judged by the shared bounds (overShared).
const sharedFloor = 64 << 10

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

// refuses says which shared bound n more bytes of cq's client would pass: "client", "budget" or ""
// (sendQueue.overShared asks it for queues with a backlog).
func (b *sendBudget) refuses(cq *clientQueued, n int) string {
	switch {
	case cq.bytes.Load()+int64(n) > b.perClient:
		return "client"
	case b.total.Load()+int64(n) > b.limit:
		return "budget"
	}
	return ""
}
