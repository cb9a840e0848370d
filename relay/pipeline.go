package relay

import (
	"context"
	"runtime/debug"
	"sync"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/store"
)

// pipeline is one connection's window of EVENTs: the read loop keeps reading while earlier EVENTs
// are being stored, up to EventWindow events and EventWindowBytes bytes; when the window is full
// it waits (backpressure: the client's frames stay in the kernel). One goroutine, the pipeline's
// worker, stores what the window holds: all of it as one group (store.Batcher.AcceptGroup), and the
// next group only once the previous group's verdicts are back. So an event is stored after every
// earlier event of its connection has committed, or after it in the same transaction (a DM open
// and the DM's first message, sent without waiting), and OKs go out in the order the EVENTs came.
//
// The window's bytes are bounded per connection (EventWindowBytes) and not counted against the
// send budgets: they are frames already read, at most one window per connection, where before
// the window there was one frame per connection (MaxMessageLength).
type pipeline struct {
	mu    sync.Mutex
	items []*pipeItem // read and not yet answered, in arrival order
	bytes int
	wake  chan struct{} // 1: items were added (for the worker)
	freed chan struct{} // 1: items were answered (for the read loop, the only one that waits)
	done  chan struct{} // closed when the worker returns
}

// pipeItem is one EVENT in the window. A decided item got its verdict in the read loop (rate
// limits, Go checks, the ephemeral dedupe): its OK only waits for its turn.
type pipeItem struct {
	ev      *nostr.Event
	raw     []byte    // the event as accept_events takes it (undecided items)
	key     string    // its lock key: the channel it names
	special bool      // not stored set-based (store.Group.Special)
	read    time.Time // when the read loop put it in the window (store.Batcher: oldest first)
	size    int
	decided bool
	ok      bool
	msg     string
}

func newPipeline() *pipeline {
	return &pipeline{wake: make(chan struct{}, 1), freed: make(chan struct{}, 1), done: make(chan struct{})}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// queueDecided puts an OK decided in the read loop in line behind the window's earlier EVENTs.
func (c *conn) queueDecided(id string, ok bool, msg string) {
	c.queueItem(&pipeItem{ev: &nostr.Event{ID: id}, size: len(id) + len(msg), decided: true, ok: ok, msg: msg,
		read: time.Now()})
}

// queueAccept puts a checked EVENT in the window, to be stored by the worker.
func (c *conn) queueAccept(ev *nostr.Event, size int) {
	c.queueItem(&pipeItem{ev: ev, raw: eventJSON(ev), key: channelOf(ev), special: !setBased(ev), size: size,
		read: time.Now()})
}

// queueItem waits for room in the window (read loop only), then adds it. An empty window always
// takes an item, however large.
func (c *conn) queueItem(it *pipeItem) {
	p := c.pipe
	for {
		p.mu.Lock()
		n := len(p.items)
		if n == 0 || (n < c.s.cfg.EventWindow && p.bytes+it.size <= c.s.cfg.EventWindowBytes) {
			p.items = append(p.items, it)
			p.bytes += it.size
			p.mu.Unlock()
			metrics.EventWindowDepth.Observe(float64(n + 1))
			signal(p.wake)
			return
		}
		p.mu.Unlock()
		select {
		case <-p.freed:
		case <-c.ctx.Done():
			return // torn down: nobody to answer
		}
	}
}

// waitEvents waits until every EVENT read so far is answered (read loop only): REQ, COUNT, CLOSE
// and AUTH then see the connection's own writes, as when each EVENT was answered before the
// next message was read.
func (c *conn) waitEvents() {
	p := c.pipe
	for {
		p.mu.Lock()
		n := len(p.items)
		p.mu.Unlock()
		if n == 0 {
			return
		}
		select {
		case <-p.freed:
		case <-c.ctx.Done():
			return
		}
	}
}

// holds reports whether an EVENT of this id waits in the window.
func (p *pipeline) holds(id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, it := range p.items {
		if !it.decided && it.ev.ID == id {
			return true
		}
	}
	return false
}

// head returns the window's first items, up to max that need storing (decided ones ride along).
func (p *pipeline) head(max int) []*pipeItem {
	p.mu.Lock()
	defer p.mu.Unlock()
	stored, n := 0, 0
	for n < len(p.items) && (p.items[n].decided || stored < max) {
		if !p.items[n].decided {
			stored++
		}
		n++
	}
	return p.items[:n:n]
}

// after returns the items that follow the first n, read by readBy, as long as fit takes those
// that need storing (store.Grow; decided ones ride along).
func (p *pipeline) after(n int, fit func(special bool) bool, readBy time.Time) []*pipeItem {
	p.mu.Lock()
	defer p.mu.Unlock()
	end := n
	for end < len(p.items) && !p.items[end].read.After(readBy) {
		if it := p.items[end]; !it.decided && !fit(it.special) {
			break
		}
		end++
	}
	return p.items[n:end:end]
}

// release drops the first n items, answered, from the window.
func (p *pipeline) release(n int) {
	p.mu.Lock()
	for _, it := range p.items[:n] {
		p.bytes -= it.size
	}
	p.items = append(p.items[:0:0], p.items[n:]...)
	p.mu.Unlock()
	signal(p.freed)
}

// pipelineLoop is the worker: it stores the window's EVENTs group by group until the connection
// ends. In-flight EVENTs then get no OK (their client is gone), and none gets two.
func (c *conn) pipelineLoop() {
	p := c.pipe
	defer close(p.done)
	for {
		select {
		case <-p.wake:
		case <-c.ctx.Done():
			return
		}
		for {
			group := p.head(c.s.batcher.MaxGroup())
			if len(group) == 0 {
				break
			}
			n, alive := c.acceptGroup(group)
			if !alive {
				return
			}
			p.release(n)
		}
	}
}

// acceptGroup stores a group's undecided EVENTs in one AcceptGroup and answers every item in
// order, with the items the group grew by while it waited for a call (store.Grow). It returns
// how many items of the window it answered, and false when the connection ended meanwhile
// (nobody to answer).
func (c *conn) acceptGroup(group []*pipeItem) (answered int, alive bool) {
	defer func() {
		if r := recover(); r != nil {
			c.log.Error("panic storing events", "panic", r, "stack", string(debug.Stack()))
			c.notice("error: internal error")
			answered, alive = len(group), c.ctx.Err() == nil
		}
	}()
	var g store.Group
	for _, it := range group {
		if !it.decided {
			if len(g.Raws) == 0 {
				g.Since = it.read
			}
			g.Raws, g.Keys = append(g.Raws, it.raw), append(g.Keys, it.key)
			if it.special {
				g.Special++
			}
		}
	}
	// Called by whichever goroutine runs the call, before the call, while this one waits for
	// the verdicts: those arrive after it, so reading group below is ordered after this write.
	g.Grow = func(fit func(special bool) bool, readBy time.Time) (more [][]byte, moreKeys []string, special int) {
		next := c.pipe.after(len(group), fit, readBy)
		group = append(group[:len(group):len(group)], next...)
		for _, it := range next {
			if !it.decided {
				more, moreKeys = append(more, it.raw), append(moreKeys, it.key)
				if it.special {
					special++
				}
			}
		}
		return more, moreKeys, special
	}
	verdicts := c.s.acceptEvents(c.ctx, g)
	i := 0
	for _, it := range group {
		if it.decided {
			c.replyEvent(it.ev.ID, it.ok, it.msg)
			continue
		}
		v := verdicts[i]
		i++
		if v.Err != nil {
			if c.ctx.Err() != nil {
				return len(group), false
			}
			c.logAcceptError(it.ev, v.Err)
			c.replyEvent(it.ev.ID, false, "error: could not store the event, try again later")
			continue
		}
		if v.OK && v.Msg == "" && isEphemeral(it.ev.Kind) {
			c.s.ephemeral.add(keyOf(it.ev.ID), timeNow())
		}
		c.replyEvent(it.ev.ID, v.OK, v.Msg)
	}
	return len(group), c.ctx.Err() == nil
}

// logAcceptError logs a failed acceptance: every event fails while the database is away, so one
// line per 10 s, with the count.
func (c *conn) logAcceptError(ev *nostr.Event, err error) {
	if log, folded := c.s.acceptErrLog.Allow(time.Now()); log {
		c.log.Error("accept_event failed", "id", ev.ID, "kind", ev.Kind, "sqlstate", db.SQLState(err), "err", err,
			"similar_since_last", folded)
	}
}

// acceptEvents stores one connection's events in their order (store.Batcher.AcceptGroup).
func (s *Server) acceptEvents(ctx context.Context, g store.Group) []store.Verdict {
	if len(g.Raws) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, acceptTimeout)
	defer cancel()
	start := time.Now()
	out := s.batcher.AcceptGroup(ctx, g)
	metrics.AcceptSeconds.Observe(time.Since(start).Seconds())
	return out
}
