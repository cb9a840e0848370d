package relay

import (
	"sync"
)

// sendQueue is a connection's outgoing message queue, bounded in bytes. Replies and live delivery
// go in without ever waiting (push; offer for the copies of one event): a reader that stays behind
// the bound is a slow client and gets closed. Initial query results wait for room (pushHalf) but
// only fill the queue up to half the bound, so a large REQ cannot by itself push live traffic over
// the edge.
type sendQueue struct {
	mu      sync.Mutex
	items   [][]byte
	owned   []bool   // owned[i]: items[i] is a pooled frame only this queue holds (pushHalfFrame)
	spare   [][]byte // the last batch's arrays, given back by recycle for the next pushes
	spareOw []bool
	size    int // bytes queued and not yet written to the socket
	limit   int
	closed  bool
	wake    chan struct{} // writer wake-up, capacity 1
	room    chan struct{} // closed and replaced when bytes leave the queue and someone waits
	waiting bool
	// The shared bounds this queue counts against (sendBudget.join; nil in unit tests), until
	// released at teardown, after which nothing it holds or writes is counted.
	budget    *sendBudget
	client    *clientQueued
	clientKey string
	released  bool
}

func newSendQueue(limit int) *sendQueue {
	return &sendQueue{limit: limit, wake: make(chan struct{}, 1), room: make(chan struct{})}
}

func (q *sendQueue) signal() {
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

// grow and shrink change size and, while the queue counts against a sendBudget, the shared
// counts with it (under q.mu).
func (q *sendQueue) grow(n int) {
	if q.released {
		return // a write finishing after teardown: nothing is counted any more
	}
	q.size += n
	if q.budget != nil {
		q.budget.add(q.client, n)
	}
}

func (q *sendQueue) shrink(n int) { q.grow(-n) }

// overShared says which shared bound n more bytes would pass ("client", "budget"; "" for none)
// when this queue holds a backlog: more than sharedFloor, which a reader that keeps up can hold
// for a moment (a batch being written is counted until written, and a burst of events waits
// behind it). So a connection is refused for the shared bounds only for a backlog of its own,
// and each queue may add up to sharedFloor beyond them (under q.mu).
func (q *sendQueue) overShared(n int) string {
	if q.budget == nil || q.size <= sharedFloor {
		return ""
	}
	return q.budget.refuses(q.client, n)
}

// push enqueues msg unless that would exceed the bound; false means overflow (or closed). An
// empty queue always takes one message, as in pushHalf: the bound is on what a reader leaves
// behind, and one that has taken everything is not behind. An outgoing message can be larger than
// the bound even when the bound is at least the incoming frame limit (Config validation): the
// relay writes U+2028 and U+2029 as 6-byte escapes that a client may send as 3 raw bytes, and
// jsonb's tag text adds spaces; refusing it would close every subscriber of one published event.
//
// push is for replies to the client's own messages (OK, CLOSED, NOTICE, COUNT): small, rate-limited
// with the messages they answer, and only this queue's bound applies to them, so a client that
// reads keeps getting its answers while others' backlogs hold the shared budget (sendBudget).
func (q *sendQueue) push(msg []byte) bool { return q.put(false, [][]byte{msg}) == "" }

// offer enqueues live messages under this queue's bound and the shared ones, and says what
// refused them: "" (taken), "closed", "queue" (this queue's bound), "client" (its client's share
// of the sendBudget) or "budget" (the process's).
//
// msgs are the copies of one event for several subscriptions of this connection (each frame
// names its subscription, so they cannot share one), taken as one unit: admitted or refused
// together by push's rule for the largest of them alone, judged on the queue as it was before
// them. Offered one by one, the copies of one large event would overflow a queue that one copy
// fits (an empty one, even), and one published event matching many subscriptions would close
// every client that holds them as slow readers. The price is in the bound: the queue can hold up
// to the limit plus one copy per subscription of the connection (MaxSubscriptions) of one
// maximal event, not more, since a unit is only admitted while one copy still fits. A reader that
// is really behind stays there: the next event finds the queue over its limit and is refused.
func (q *sendQueue) offer(msgs ...[]byte) string { return q.put(true, msgs) }

func (q *sendQueue) put(shared bool, msgs [][]byte) string {
	largest, total := 0, 0
	for _, m := range msgs {
		largest = max(largest, len(m))
		total += len(m)
	}
	q.mu.Lock()
	why := ""
	switch {
	case q.closed:
		why = "closed"
	case q.size == 0: // an empty queue takes them, whatever the bounds
	case q.size+largest > q.limit:
		why = "queue"
	case shared:
		why = q.overShared(largest)
	}
	if why != "" {
		q.mu.Unlock()
		return why
	}
	q.reuseSpare()
	q.items = append(q.items, msgs...)
	for range msgs {
		q.owned = append(q.owned, false)
	}
	q.grow(total)
	q.mu.Unlock()
	q.signal()
	return ""
}

// pushHalf enqueues msg if the queue is at most half full after it (an empty queue always takes
// one message) and never waits. When there is no room it returns a channel that is closed once
// bytes leave the queue. done reports that the queue is closed (nothing will ever be sent).
func (q *sendQueue) pushHalf(msg []byte) (ok bool, room <-chan struct{}, done bool) {
	return q.pushHalfFrame(msg, false)
}

// pushHalfFrame is pushHalf; owned says msg is a frame from getFrame that nothing else refers to:
// once written, the writer gives it back to its pool (recycle).
func (q *sendQueue) pushHalfFrame(msg []byte, owned bool) (ok bool, room <-chan struct{}, done bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closed {
		return false, nil, true
	}
	if q.size == 0 || (q.size+len(msg) <= q.limit/2 && q.overShared(len(msg)) == "") {
		q.reuseSpare()
		q.items = append(q.items, msg)
		q.owned = append(q.owned, owned)
		q.grow(len(msg))
		q.signal()
		return true, nil, false
	}
	q.waiting = true
	return false, q.room, false
}

// reuseSpare starts an empty queue on the arrays of the last written batch (under q.mu).
func (q *sendQueue) reuseSpare() {
	if q.items == nil && q.spare != nil {
		q.items, q.owned = q.spare, q.spareOw
		q.spare, q.spareOw = nil, nil
	}
}

// take removes and returns the oldest queued messages, at most max bytes of them (and at least one
// message, whatever its size). The bytes stay counted until written (written).
func (q *sendQueue) take(max int) [][]byte {
	msgs, _ := q.takeFrames(max)
	return msgs
}

// takeFrames is take, with which of the messages are owned frames (pushHalfFrame).
func (q *sendQueue) takeFrames(max int) (msgs [][]byte, owned []bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	n, size := 0, 0
	for n < len(q.items) && (n == 0 || size+len(q.items[n]) <= max) {
		size += len(q.items[n])
		n++
	}
	if n == len(q.items) {
		items, own := q.items, q.owned
		q.items, q.owned = nil, nil
		return items, own
	}
	items := make([][]byte, n)
	copy(items, q.items)
	own := make([]bool, n)
	copy(own, q.owned)
	clear(q.items[:n]) // the rest keeps the backing array; do not let it pin what is sent
	q.items, q.owned = q.items[n:], q.owned[n:]
	return items, own
}

// recycle takes back a batch from takeFrames once it is written in full: its owned frames go
// back to their pools, and its arrays serve the next pushes. Nothing may use the batch after.
func (q *sendQueue) recycle(msgs [][]byte, owned []bool) {
	for i, m := range msgs {
		if owned[i] {
			putFrame(m)
		}
	}
	clear(msgs) // the spare must not pin what was sent
	q.mu.Lock()
	if cap(msgs) > cap(q.spare) {
		q.spare, q.spareOw = msgs[:0], owned[:0]
	}
	q.mu.Unlock()
}

// written releases n bytes after they reached the socket.
func (q *sendQueue) written(n int) {
	q.mu.Lock()
	q.shrink(n)
	if q.waiting {
		q.waiting = false
		close(q.room)
		q.room = make(chan struct{})
	}
	q.mu.Unlock()
}

// closeWith drops everything not yet taken, queues last (if any) as the final message and refuses
// further pushes. It returns false when the queue was already closed.
func (q *sendQueue) closeWith(last []byte) bool {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return false
	}
	q.closed = true
	for _, it := range q.items {
		q.shrink(len(it))
	}
	q.items, q.owned = nil, nil
	q.spare, q.spareOw = nil, nil
	if last != nil {
		q.items = append(q.items, last)
		q.owned = append(q.owned, false)
		q.grow(len(last))
	}
	close(q.room) // wake pushHalf waiters so they see closed
	q.room = make(chan struct{})
	q.mu.Unlock()
	q.signal()
	return true
}

func (q *sendQueue) isClosed() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.closed
}

func (q *sendQueue) empty() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items) == 0
}

// release ends the queue for good at teardown: it refuses everything from now on and gives what
// it still counts back to its sendBudget, bytes taken by a write that failed included.
func (q *sendQueue) release() {
	q.mu.Lock()
	if q.released {
		q.mu.Unlock()
		return
	}
	q.closed = true
	q.items, q.owned = nil, nil
	q.spare, q.spareOw = nil, nil
	q.shrink(q.size)
	q.released = true
	b, cq, key := q.budget, q.client, q.clientKey
	close(q.room)
	q.room = make(chan struct{})
	q.mu.Unlock()
	if b != nil {
		b.leave(key, cq)
	}
}
