package relay

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

var timeNow = time.Now

// conn is one WebSocket client. Three kinds of goroutine touch it: its read loop (handles
// messages in order), its write loop (the only writer of data frames), and query goroutines
// plus Deliver callers, which only ever enqueue on q.
type conn struct {
	s         *Server
	ws        *websocket.Conn
	id        uint64
	log       *slog.Logger
	challenge string
	relayURL  string

	ctx    context.Context // ends when the connection is torn down
	cancel context.CancelFunc

	authed atomic.Pointer[[]string] // copy-on-write list of authenticated pubkeys

	mu      sync.Mutex // guards subs and dueSeen; taken before any subscription's mu
	subs    map[string]*subscription
	dueSeen *idFIFO[dueKey]

	q        *sendQueue
	frames   frameWriter // the write loop's own
	querySem chan struct{}
	// initialHeld is what this connection's initial answers hold of the process-wide budget.
	initialHeld atomic.Int64
	// pong carries the payload of the latest client ping to the write loop, which answers it.
	// gorilla's default ping handler would write the pong from the read loop with its own 1 s
	// deadline on the socket, cutting short a batch write blocked on a slow reader.
	pong chan string

	ip          string       // what per-IP caps and rates count (limitKey): the address, or its /64 for IPv6
	eventBucket *tokenBucket // read loop only
	reqBucket   *tokenBucket
	// limitedStreak counts refusals in a row (read loop only).
	limitedStreak int

	killOnce    sync.Once
	closeReason atomic.Value // string: why the connection ended (first reason wins)
	pipe        *pipeline    // EVENTs read and not yet answered (pipeline.go)
	closing     atomic.Pointer[closeInfo]
	writerDone  chan struct{}

	inbox *inbox // live deliveries to match (deliverLoop)
	// deliverMu serializes matching what the inbox holds (drainInbox): the order of deliveries
	// to one connection is the fan-out's.
	deliverMu   sync.Mutex
	deliverDone chan struct{}
	share       *deliveryShare // its client's (deliveryShares), until teardown
}

func newConn(s *Server, ws *websocket.Conn, r *http.Request, relayURL, ip, key string) *conn {
	var b [16]byte
	_, _ = rand.Read(b[:])
	ctx, cancel := context.WithCancel(context.Background())
	c := &conn{
		s:          s,
		ws:         ws,
		id:         s.nextID.Add(1),
		challenge:  hex.EncodeToString(b[:]),
		relayURL:   relayURL,
		ctx:        ctx,
		cancel:     cancel,
		subs:       map[string]*subscription{},
		dueSeen:    newIDFIFO[dueKey](duePerConn),
		q:          newSendQueue(s.cfg.SendQueueBytes),
		querySem:   make(chan struct{}, s.cfg.MaxQueriesInFlight),
		writerDone: make(chan struct{}),
		pong:       make(chan string, 1),
		ip:         key,
		pipe:       newPipeline(),
	}
	c.inbox, c.deliverDone = newInbox(), make(chan struct{})
	if s.cfg.EventRate > 0 {
		c.eventBucket = newTokenBucket(s.cfg.EventRate, s.cfg.EventBurst)
	}
	if s.cfg.ReqRate > 0 {
		c.reqBucket = newTokenBucket(s.cfg.ReqRate, s.cfg.ReqBurst)
	}
	s.sends.join(c.q, key) // until c.q.release at teardown
	c.share = s.shares.join(key)
	c.log = s.log.With("conn", c.id, "remote", r.RemoteAddr, "client_ip", ip)
	empty := []string{}
	c.authed.Store(&empty)
	return c
}

// authedList returns the pubkeys authenticated on this connection (never mutated in place).
func (c *conn) authedList() []string { return *c.authed.Load() }

// run is the read loop; it returns when the connection is finished and cleaned up.
func (c *conn) run() {
	c.ws.SetReadLimit(int64(c.s.cfg.MaxMessageLength))
	_ = c.ws.SetReadDeadline(timeNow().Add(c.s.readWait))
	c.ws.SetPongHandler(func(string) error {
		return c.ws.SetReadDeadline(timeNow().Add(c.s.readWait))
	})
	c.ws.SetPingHandler(func(data string) error {
		// Only the latest ping needs an answer (RFC 6455 5.5.3).
		select {
		case <-c.pong:
		default:
		}
		c.pong <- data // the read loop is the only sender, so there is room now
		return c.ws.SetReadDeadline(timeNow().Add(c.s.readWait))
	})
	go c.writeLoop()
	go c.pipelineLoop()
	go c.deliverLoop()
	c.log.Debug("connected")
	c.send(marshalArray("AUTH", c.challenge))

	reason := "client closed"
	for {
		_, data, err := c.ws.ReadMessage()
		if err != nil {
			switch {
			case errors.Is(err, websocket.ErrReadLimit):
				// gorilla already sent close 1009 (message too big).
				reason = "message too big"
				c.drainOversized()
			case websocket.IsCloseError(err, websocket.CloseNormalClosure, websocket.CloseGoingAway, websocket.CloseNoStatusReceived):
			default:
				if c.ctx.Err() == nil {
					reason = "read: " + err.Error()
				}
			}
			break
		}
		if c.closing.Load() != nil {
			// Being closed (send queue overflow, rate limits ignored, shutdown): read on only
			// until the close handshake ends, so that a flood keeps no PostgreSQL work going
			// for the grace period.
			continue
		}
		c.handle(data)
		// Renewed after handling, not before: handling can wait for the client's own queries
		// (the per-connection bound), and that wait must not count against its read deadline.
		_ = c.ws.SetReadDeadline(timeNow().Add(c.s.readWait))
	}
	if r, ok := c.closeReason.Load().(string); ok {
		reason = r
	}
	c.kill(reason)
	<-c.writerDone
	<-c.pipe.done
	<-c.deliverDone
	c.inbox.close(c.s.ipInbox, c.ip)
	c.mu.Lock()
	for id, sub := range c.subs {
		sub.close()
		delete(c.subs, id)
	}
	c.mu.Unlock()
	c.log.Debug("disconnected", "reason", reason)
	c.q.release()
	c.s.shares.leave(c.ip, c.share)
	c.s.removeConn(c, reason)
}

// handle processes one client message; no panic escapes it.
func (c *conn) handle(data []byte) {
	defer func() {
		if p := recover(); p != nil {
			c.log.Error("panic handling message", "panic", p, "stack", string(debug.Stack()))
			c.notice("error: internal error")
		}
	}()
	msg, perr := parseClientMessage(data)
	if perr != nil && perr.eventID != "" {
		c.queueDecided(perr.eventID, false, "invalid: "+perr.msg)
		return
	}
	if perr != nil || msg.verb != verbEVENT {
		c.waitEvents() // replies in order, and reads see the connection's own writes
	}
	if perr != nil {
		switch {
		case perr.subID != "" && (perr.verb == verbREQ || perr.verb == verbCOUNT):
			// A REQ replaces the subscription of its id whatever happens next (handleReq), a
			// malformed one too; a COUNT's CLOSED reads as the end of a REQ of the same id
			// (closeID). Either way the CLOSED must not name a subscription that still
			// delivers. Exact match only; an over-long id names no registered subscription.
			c.closeID(perr.subID, "invalid: "+perr.msg)
		default:
			c.notice("invalid: " + perr.msg)
		}
		return
	}
	switch msg.verb {
	case verbEVENT:
		c.handleEvent(msg.event, len(data))
	case verbREQ:
		c.handleReq(msg.subID, msg.filters)
	case verbCOUNT:
		c.handleCount(msg.subID, msg.filters)
	case verbCLOSE:
		c.handleClose(msg.subID)
	case verbAUTH:
		c.handleAuth(msg.event)
	}
}

// writeLoop is the only goroutine that writes data frames. It also pings and answers pings, so
// no other write changes the socket's write deadline under a batch in progress.
func (c *conn) writeLoop() {
	defer close(c.writerDone)
	ping := time.NewTicker(c.s.pingEvery)
	defer ping.Stop()
	for {
		select {
		case <-c.q.wake:
			if !c.writeQueued(ping.C) {
				return
			}
			if c.q.isClosed() && c.q.empty() {
				// A graceful close: everything queued before closeWith went out; say goodbye.
				code, text := c.closeCode()
				_ = c.ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(code, text), timeNow().Add(time.Second))
				// The read loop ends when the client answers the close frame, or at the grace timer.
				return
			}
		case <-ping.C:
			if !c.writePing() {
				return
			}
		case data := <-c.pong:
			if !c.writePong(data) {
				return
			}
		case <-c.ctx.Done():
			return
		}
	}
}

// writeQueued writes what is queued, a bounded batch per write: the deadline then asks for
// progress (writeBatch bytes per writeWait), not for the whole queue at once, which a client on a
// slow link could not take within it. It returns false when the connection is done.
func (c *conn) writeQueued(ping <-chan time.Time) bool {
	for {
		batch, owned := c.q.takeFrames(writeBatch)
		if len(batch) == 0 {
			return true
		}
		n, err := c.frames.write(c.ws.NetConn(), batch, c.s.writeWait)
		c.q.written(n)
		if err != nil {
			c.writeFailed(err)
			return false
		}
		c.q.recycle(batch, owned)
		// A full batch left while more is queued: a backlog (a long answer, a flood) is
		// draining, so the client is reading. The read deadline is there to find dead
		// clients (pongWait), and a backlog to a slow reader (which only answers pings, as
		// browsers do) can take longer than that while its pong waits behind the data in
		// the kernel. A client that stops reading is still found: the kernel buffers fill,
		// the next write blocks, and writeWait ends it. A write that emptied the queue
		// proves nothing (the kernel took a few events for a peer that may be gone), so it
		// does not renew: trickling events must not keep a silent connection for good.
		if !c.q.empty() {
			_ = c.ws.SetReadDeadline(timeNow().Add(c.s.readWait))
			// A backlog is written one batch per turn, as deliverLoop matches one event per
			// turn: other connections' writes do not wait for a whole time slice behind it.
			runtime.Gosched()
		}
		// A client's ping is answered, and the relay's own keepalive ping sent when
		// due, between batches, not after the queue runs dry (a steady stream to a
		// slow reader, or an answer the query keeps refilling, may never let it).
		select {
		case data := <-c.pong:
			if !c.writePong(data) {
				return false
			}
		default:
		}
		select {
		case <-ping:
			if !c.writePing() {
				return false
			}
		default:
		}
	}
}

// writeFailed ends the connection after a failed write. A write that timed out is a client not
// reading what it asked for (initial results wait for room in the queue instead of overflowing
// it): the usual end of a slow REQ reader, so it is counted and logged like an overflow.
func (c *conn) writeFailed(err error) {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() && c.closing.Load() == nil && c.ctx.Err() == nil {
		metrics.SlowClientsClosed.WithLabelValues("write_timeout").Inc()
		c.log.Warn("write timed out, closing slow client", "write_wait", c.s.writeWait.String())
	}
	c.kill("write: " + err.Error())
}

// writePing sends the relay's keepalive ping; false when the connection is done.
func (c *conn) writePing() bool {
	if err := c.ws.WriteControl(websocket.PingMessage, nil, timeNow().Add(c.s.writeWait)); err != nil {
		c.kill("ping: " + err.Error())
		return false
	}
	return true
}

// writePong answers the client's latest ping; false when the connection is done.
func (c *conn) writePong(data string) bool {
	if err := c.ws.WriteControl(websocket.PongMessage, []byte(data), timeNow().Add(c.s.writeWait)); err != nil {
		c.kill("pong: " + err.Error())
		return false
	}
	return true
}

// frameWriter writes msgs as unfragmented, unmasked text frames (RFC 6455 5.2, server to client)
// in one writev. gorilla writes one message per syscall; a REQ answer of 100 events is then 100
// syscalls, the largest cost of a query after PostgreSQL itself. Writing frames directly is safe
// beside gorilla's own control frames (ping, close): each is a single Write on the net.Conn, whose
// writes are atomic with respect to each other. The writer goroutine owns it: the headers and the
// vector are reused from one batch to the next, not allocated for each.
type frameWriter struct {
	headers []byte
	bufs    net.Buffers
}

// write writes one batch and returns its payload bytes.
func (w *frameWriter) write(nc net.Conn, msgs [][]byte, wait time.Duration) (int, error) {
	if need := 10 * len(msgs); cap(w.headers) < need {
		w.headers = make([]byte, 0, need) // never grown below: bufs point into it
	}
	headers, bufs := w.headers[:0], w.bufs[:0]
	total := 0
	for _, m := range msgs {
		start := len(headers)
		headers = append(headers, 0x81) // FIN + text
		switch n := len(m); {
		case n <= 125:
			headers = append(headers, byte(n))
		case n <= 0xffff:
			headers = append(headers, 126, byte(n>>8), byte(n))
		default:
			headers = append(headers, 127, 0, 0, 0, 0, byte(n>>24), byte(n>>16), byte(n>>8), byte(n))
		}
		bufs = append(bufs, headers[start:len(headers):len(headers)], m)
		total += len(m)
	}
	w.bufs = bufs
	_ = nc.SetWriteDeadline(timeNow().Add(wait))
	_, err := bufs.WriteTo(nc) // consumes bufs, not w.bufs
	clear(w.bufs)              // the frames may go back to their pools: hold none of them
	return total, err
}

type closeInfo struct {
	code int
	text string
}

func (c *conn) closeCode() (int, string) {
	if ci := c.closing.Load(); ci != nil {
		return ci.code, ci.text
	}
	return websocket.CloseNormalClosure, ""
}

// closeGracefully drops what is still queued (the client is going away or too slow to get it
// anyway), sends the notice (if any) and a close frame, and cuts the connection after a grace
// period if the client does not answer the close frame.
func (c *conn) closeGracefully(code int, text, notice string) {
	var last []byte
	if notice != "" {
		last = marshalArray("NOTICE", notice)
	}
	c.closing.CompareAndSwap(nil, &closeInfo{code, text})
	if !c.q.closeWith(last) {
		return
	}
	c.closeReason.CompareAndSwap(nil, text)
	time.AfterFunc(slowCloseGrace, func() { c.kill(text) })
}

// After close 1009, the rest of the client's frame is read and dropped for oversizeDrain at most,
// and a pause of oversizeDrainIdle ends that early.
const (
	oversizeDrain     = 2 * time.Second
	oversizeDrainIdle = 500 * time.Millisecond
)

// drainOversized follows the close frame (1009) that gorilla sent from the header of a message
// over the read limit. The client is most likely still sending that message: a socket closed with
// its bytes unread makes the kernel answer with a reset, which ends the client's write with an
// error, and most clients then report 1006 (abnormal closure) whatever close frame came first. So
// the rest is read and dropped until the client closes or pauses, or oversizeDrain has passed.
// Nothing else is sent meanwhile (no data frame may follow a close frame), and the connection's
// queries stop.
func (c *conn) drainOversized() {
	c.closing.CompareAndSwap(nil, &closeInfo{websocket.CloseMessageTooBig, "message too big"})
	c.q.closeWith(nil)
	c.cancel()
	nc := c.ws.NetConn()
	end := timeNow().Add(oversizeDrain)
	buf := make([]byte, 32<<10)
	for {
		deadline := timeNow().Add(oversizeDrainIdle)
		if deadline.After(end) {
			deadline = end
		}
		_ = nc.SetReadDeadline(deadline)
		if _, err := nc.Read(buf); err != nil {
			return
		}
	}
}

// kill tears the connection down now: it unblocks the read loop, the write loop and every query.
func (c *conn) kill(reason string) {
	c.killOnce.Do(func() {
		c.closeReason.CompareAndSwap(nil, reason)
		c.cancel()
		_ = c.ws.Close()
		c.q.closeWith(nil)
	})
}

// overflow handles a live push that did not fit (why: what refused it, sendQueue.offer): the
// client stays behind, so it is told and closed.
func (c *conn) overflow(why string) {
	if why == "" || c.q.isClosed() {
		return
	}
	switch why {
	case "inbox", "ip_inbox":
		// Its live deliveries wait to be matched faster than its goroutine matches them: too many
		// subscriptions for the events it asks for, or a share of the CPU too small for them.
		metrics.SlowClientsClosed.WithLabelValues(why).Inc()
		c.log.Warn("live deliveries waiting to be matched over the bound, closing slow client", "bound", why,
			"inbox_events", c.s.cfg.InboxEvents, "ip_inbox_events", c.s.cfg.InboxEventsPerIP)
	case "client":
		metrics.SlowClientsClosed.WithLabelValues("client_share").Inc()
		c.log.Warn("send queues of this client over its share, closing slow client", "share_bytes", c.s.cfg.SendClientShare)
	case "budget":
		metrics.SlowClientsClosed.WithLabelValues("send_budget").Inc()
		c.log.Warn("send queues over the process's budget, closing a slow client", "budget_bytes", c.s.cfg.SendBudget)
	default:
		metrics.SlowClientsClosed.WithLabelValues("overflow").Inc()
		c.log.Warn("send queue overflow, closing slow client", "limit_bytes", c.s.cfg.SendQueueBytes)
	}
	c.closeGracefully(websocket.ClosePolicyViolation, "send queue overflow", "error: too slow, send queue full")
}

// send enqueues a reply to the client's own message; like live delivery it never waits: a full
// queue means the client is not reading.
func (c *conn) send(msg []byte) {
	if !c.q.push(msg) {
		c.overflow("queue")
	}
}

func (c *conn) notice(text string) { c.send(marshalArray("NOTICE", text)) }

func (c *conn) sendOK(id string, ok bool, msg string) {
	c.send(marshalOK(id, ok, msg))
}

func (c *conn) sendClosed(subID, msg string) { c.send(marshalArray("CLOSED", subID, msg)) }

// closeID answers CLOSED for subID and ends the REQ of that id, if one is live. NIP-45 answers a
// refused or failed COUNT with CLOSED, and a client cannot tell that CLOSED from one ending a REQ
// of the same id (NIP-01: the relay ended the subscription); it drops the REQ, so the relay must
// not go on delivering to it. Under c.mu, so that no REQ of that id registers between the two.
func (c *conn) closeID(subID, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if sub := c.subs[subID]; sub != nil {
		delete(c.subs, subID)
		sub.close()
	}
	c.sendClosed(subID, reason) // never waits (send), as Deliver enqueues under c.mu too
}
