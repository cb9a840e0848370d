package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// MaxBatch is the most events one buzz.accept_events call takes (sql/0002_accept.up.sql). A call
// of more than maxSubtransactions events must also keep its subtransactions within that bound.
const MaxBatch = 120

// maxSubtransactions bounds the subtransactions of one call: accept_events runs each event that
// is not stored set-based in one, and each run of set-based events in one. PostgreSQL caches 64
// subtransaction ids per backend; past them every snapshot taken meanwhile gets slower.
const maxSubtransactions = 60

// BatchLockWait bounds every lock wait of a call made while holding a batch slot. A call that
// waits longer (a lock held by an operator's open transaction, two batches locking the same rows
// in opposite orders) gives up with 55P03 and its events are stored one by one outside the
// slots, as without batching: no slot is held for long, so one blocked event never stalls the
// others.
const BatchLockWait = 50 * time.Millisecond

// minCallTime is the least time an event must have left to join a call (see take).
const minCallTime = time.Second

// Batcher stores events as AcceptJSON does, but groups the ones that arrive while earlier calls
// are running into one buzz.accept_events call: one transaction, one WAL flush and one walsender
// wake-up for all of them (group commit). There is no background goroutine: a caller whose event
// is still queued starts a call and runs the queue's head itself, so an idle relay runs each
// event at once and a busy one runs bigger batches.
//
// One call runs whenever events wait. More, up to inflight, start only while a full batch waits
// and a quarter or more of the waiting events are special: at a steady rate one call at a time
// keeps latency low and CPU per event down (bigger batches), and a flood of events PostgreSQL
// stores one by one (ten times the backend CPU of a plain one) gets the other cores. A flood of
// plain events goes one call at a time: the relay spends as much CPU verifying them as PostgreSQL
// storing them, so a second call only takes CPU from the relay and from the first call, whose
// events, the oldest, then wait longest (ingest16's OK p99 ÷ mean 1.80-2.14 with 3 calls, 1.38-1.65
// with 1; docs/benchmarks.md).
//
// Every event still gets the verdict accept_event gives it alone: each runs in its own
// subtransaction, and a call PostgreSQL refuses as a whole (a lock wait over BatchLockWait, a
// deadlock) is retried event by event (AcceptJSON, with its deadlock retries). A call whose
// outcome is unknown (the connection lost) answers each of its events with an error, as a lost
// single call does.
type Batcher struct {
	base     context.Context
	pool     *pgxpool.Pool
	max      int
	inflight int
	timeout  time.Duration

	mu            sync.Mutex
	queue         []*pendingAccept
	queued        int           // events in queue
	queuedSpecial int           // of them, special (Group.Special)
	running       int           // calls in flight
	changed       chan struct{} // closed (and replaced) when a call may start that could not before

	// onBatch, when set (in-package tests), is called with each call's lock keys, in the call's
	// order, before it runs, holding the slot: a test can stop a call there and let events queue
	// behind it.
	onBatch func(keys []string)
}

// pendingAccept is one group of events: one connection's EVENTs read while its earlier ones were
// being stored (relay/pipeline.go), or one event alone. A group stays together and in its order
// within a call, so an event sits after every earlier event of its connection in the same
// transaction (a DM open and the DM's first message, sent without waiting).
type pendingAccept struct {
	ctx     context.Context
	raws    [][]byte
	keys    []string
	special int       // events that will not be stored set-based (Group.Special)
	key     string    // lock order of the group: its smallest event key ("" for none)
	since   time.Time // when its oldest event was read: the queue runs oldest first
	grow    Grow      // asked for more events when a call takes the group (nil: none)
	taken   bool      // in a batch: its owner waits for done and takes no slot (guarded by Batcher.mu)
	done    chan []Verdict
}

// Verdict is one event's outcome, as AcceptJSON returns it.
type Verdict struct {
	OK  bool
	Msg string
	Err error
}

// NewBatcher returns a Batcher running at most inflight calls at once (each on its own pool
// connection; see Batcher for when more than one runs), of at most maxEvents events each (capped at MaxBatch). maxEvents 1 turns batching
// off: Accept is then AcceptJSON. timeout bounds one call; base ends every call in flight when it
// ends (the relay's connections being killed at shutdown).
func NewBatcher(base context.Context, pool *pgxpool.Pool, maxEvents, inflight int, timeout time.Duration) *Batcher {
	maxEvents = min(max(maxEvents, 1), MaxBatch)
	return &Batcher{base: base, pool: pool, max: maxEvents, inflight: max(inflight, 1), timeout: timeout,
		changed: make(chan struct{})}
}

// Accept stores one verified event and returns its OK verdict, as AcceptJSON. lockKey is the
// channel the event names (its h tag; "" for none): a call runs its groups in lockKey order, so
// two calls (two processes) that both post to two channels lock them in the same order. A DM
// message locks every member row of its DM until its call commits (buzz.lock_dm); in arrival
// order, two such calls could each hold one DM and wait for the other's until the lock wait
// bound sent both back to single events.
func (b *Batcher) Accept(ctx context.Context, raw []byte, lockKey string) (ok bool, message string, err error) {
	v := b.AcceptGroup(ctx, Group{Since: time.Now(), Raws: [][]byte{raw}, Keys: []string{lockKey}, Special: 1})[0]
	return v.OK, v.Msg, v.Err
}

// Group is one connection's events, stored in their order (AcceptGroup).
type Group struct {
	// Since is when the oldest event was read: queued groups are taken oldest first, so a group
	// that waited behind its connection's previous one (relay/pipeline.go) does not wait again
	// behind groups read after it.
	Since time.Time
	Raws  [][]byte // the events, as accept_event takes them
	Keys  []string // their lock keys (Accept)
	// Special counts the events that accept_events will not store set-based (buzz.plain_events
	// decides; the caller's guess may only err upwards): a call keeps its subtransactions within
	// maxSubtransactions by them.
	Special int
	Grow    Grow // when not nil, adds events to the group's last call when a call takes it
}

// AcceptGroup stores g's events in their order and returns their verdicts, in that order: each
// is stored after every earlier one has committed, or after it in the same transaction. Groups of
// more than the batch size go in consecutive calls, each after the previous one's verdicts. The
// events the group grew by (Grow) get their verdicts after the others.
func (b *Batcher) AcceptGroup(ctx context.Context, g Group) []Verdict {
	raws, keys := g.Raws, g.Keys
	out := make([]Verdict, 0, len(raws))
	for len(raws) > 0 {
		n := min(len(raws), b.max)
		if !b.fits(n, min(n, g.Special)) {
			n = maxSubtransactions // then it fits whatever it holds
		}
		if b.max == 1 {
			ok, msg, err := AcceptJSON(ctx, b.pool, raws[0])
			out = append(out, Verdict{ok, msg, err})
		} else {
			p := &pendingAccept{ctx: ctx, raws: raws[:n:n], keys: keys[:n:n], key: slices.Min(keys[:n]), since: g.Since,
				special: min(n, g.Special), done: make(chan []Verdict, 1)}
			if n == len(raws) {
				p.grow = g.Grow
			}
			out = append(out, b.acceptOne(p)...)
		}
		raws, keys = raws[n:], keys[n:]
	}
	return out
}

// Grow returns more events of a group (their lock keys, and how many of them are special:
// Group.Special), in their order after the group's: the ones its connection read while the group
// waited for a call, up to readBy. It offers them one by one to fit, which says whether the call
// has room for one more (special or not) and counts it in; it stops at the first that does not
// fit. It is called with the batcher's lock held, when a call takes the group, so it must be
// quick. A group that grows while it waits goes as one call where it would have gone as a small
// call and then, after that call's commit, a second one.
type Grow func(fit func(special bool) bool, readBy time.Time) (raws [][]byte, keys []string, special int)

// MaxGroup is the most events one call takes: a larger group goes in several calls.
func (b *Batcher) MaxGroup() int { return b.max }

// acceptOne queues one group of at most b.max events and waits for its verdicts, running calls
// itself while it waits and one may start (mayStart).
func (b *Batcher) acceptOne(p *pendingAccept) []Verdict {
	ctx := p.ctx
	b.mu.Lock()
	b.enqueueLocked(p)
	b.queued += len(p.raws)
	b.queuedSpecial += p.special
	if b.running > 0 && b.mayStartLocked() {
		b.wakeLocked() // a full batch waits: a waiter (maybe this caller) starts another call
	}
	b.mu.Unlock()
	for {
		b.mu.Lock()
		// Taken: someone runs it, so wait for the verdict and start nothing.
		start := !p.taken && b.mayStartLocked()
		if start {
			b.running++
		}
		changed := b.changed
		b.mu.Unlock()
		if start {
			b.runNext()
			continue
		}
		select {
		case v := <-p.done:
			return v
		case <-ctx.Done():
			// Still queued: the next runner drops it. Taken: its verdict is dropped.
			b.mu.Lock()
			n := len(p.raws) // grown, if taken
			b.mu.Unlock()
			return same(n, Verdict{Err: ctx.Err()})
		case <-changed:
		}
	}
}

// enqueueLocked puts p behind every queued group read no later than it: oldest first, and in
// arrival order among equals.
func (b *Batcher) enqueueLocked(p *pendingAccept) {
	i := len(b.queue)
	for i > 0 && b.queue[i-1].since.After(p.since) {
		i--
	}
	b.queue = slices.Insert(b.queue, i, p)
}

// mayStartLocked says whether a waiting caller may start a call now: the first whenever events
// wait, more only while a full batch waits, a quarter or more of it special (Batcher).
func (b *Batcher) mayStartLocked() bool {
	if b.queued == 0 || b.running >= b.inflight {
		return false
	}
	full := !b.fits(b.queued+1, b.queuedSpecial) // not one more fits
	return b.running == 0 || full && 4*b.queuedSpecial >= b.queued
}

// wakeLocked wakes every caller waiting for a chance to start a call.
func (b *Batcher) wakeLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// callDone ends a call started by acceptOne and wakes the waiters if another may start.
func (b *Batcher) callDone() {
	b.mu.Lock()
	b.running--
	if b.mayStartLocked() {
		b.wakeLocked()
	}
	b.mu.Unlock()
}

// same is n copies of v.
func same(n int, v Verdict) []Verdict {
	out := make([]Verdict, n)
	for i := range out {
		out[i] = v
	}
	return out
}

// take removes whole groups from the queue's head, up to b.max events whose owners still wait,
// and marks them taken. It stops at the first group that does not fit, so groups keep their
// order across calls. Then the taken groups may grow into the room left (Grow).
func (b *Batcher) take() []*pendingAccept {
	b.mu.Lock()
	defer b.mu.Unlock()
	var batch []*pendingAccept
	n, events, special := 0, 0, 0
	for n < len(b.queue) && b.fits(events+len(b.queue[n].raws), special+b.queue[n].special) {
		p := b.queue[n]
		b.queue[n] = nil
		n++
		b.queued -= len(p.raws)
		b.queuedSpecial -= p.special
		if p.ctx.Err() != nil {
			continue // its owner has gone
		}
		if d, ok := p.ctx.Deadline(); ok && time.Until(d) < minCallTime {
			// Too little time left to be worth a call: run, it would cut the call short for the
			// whole batch (calls end at their events' earliest deadline).
			p.taken = true
			answer(p, same(len(p.raws), Verdict{Err: errNoTimeLeft}))
			continue
		}
		p.taken = true
		batch = append(batch, p)
		events += len(p.raws)
		special += p.special
	}
	b.queue = b.queue[n:]
	if len(b.queue) == 0 {
		b.queue = nil // let the backing array go
	}
	// Grown events were read after the group's own: none jumps a group still queued that was read
	// before it.
	readBy := time.Now()
	if len(b.queue) > 0 {
		readBy = b.queue[0].since
	}
	fit := func(sp bool) bool {
		e, s := events+1, special
		if sp {
			s++
		}
		if !b.fits(e, s) {
			return false
		}
		events, special = e, s
		return true
	}
	for _, p := range batch {
		if p.grow != nil && events < b.max {
			raws, keys, sp := p.grow(fit, readBy)
			p.raws, p.keys = append(p.raws, raws...), append(p.keys, keys...)
			p.key = slices.Min(p.keys)
			p.special += sp
		}
	}
	return batch
}

// fits says whether a call of events events, special of them special (Group.Special), keeps
// within b.max and maxSubtransactions. Set-based runs lie between special events, so a call has
// at most min(events, 2*special+1) subtransactions.
func (b *Batcher) fits(events, special int) bool {
	return events <= b.max && min(events, 2*special+1) <= maxSubtransactions
}

// runNext runs the queue's head as one call, counted in running by its caller, and ends it.
// Every event it takes gets exactly one verdict, a panic included (the caller's recover answers
// its own message; the others must not wait for ever).
func (b *Batcher) runNext() {
	defer b.callDone()
	batch := b.take()
	if len(batch) == 0 {
		return
	}
	answered := false
	defer func() {
		if !answered {
			for _, p := range batch {
				answer(p, same(len(p.raws), Verdict{Err: errBatchAbandoned}))
			}
		}
	}()
	// Groups, not events, are sorted: a group's events keep their connection's order. Stable:
	// groups of one channel keep their arrival order.
	slices.SortStableFunc(batch, func(x, y *pendingAccept) int { return strings.Compare(x.key, y.key) })
	metrics.AcceptBatchEvents.Observe(float64(countEvents(batch)))
	if b.onBatch != nil {
		var keys []string
		for _, p := range batch {
			keys = append(keys, p.keys...)
		}
		b.onBatch(keys)
	}
	ctx, cancel := b.callContext(batch)
	defer cancel()
	metrics.AcceptCallsInFlight.Inc()
	start := time.Now()
	verdicts, err := b.call(ctx, batch)
	metrics.AcceptCallSeconds.Observe(time.Since(start).Seconds())
	metrics.AcceptCallsInFlight.Dec()
	answered = true
	if err != nil && ctx.Err() != nil {
		// Cut short by shutdown or a deadline: the events' owners are gone or going, and a
		// cancellation that reached the server only after its commit would make a second run
		// answer "duplicate:". Whatever PostgreSQL said, answer as for an unknown outcome.
		for _, p := range batch {
			answer(p, same(len(p.raws), Verdict{Err: fmt.Errorf("accept_events: outcome unknown: %w", err)}))
		}
		return
	}
	if err != nil {
		// PostgreSQL refused the call, so nothing of it is committed. Each group goes again on its
		// own, outside the slots, waiting for locks as long as its own context lets it.
		metrics.AcceptBatchFallbacks.WithLabelValues(db.SQLState(err)).Inc()
		for _, p := range batch {
			go b.acceptInOrder(p)
		}
		return
	}
	i := 0
	for _, p := range batch {
		answer(p, verdicts[i:i+len(p.raws)])
		i += len(p.raws)
	}
}

// acceptInOrder stores a group's events one by one, each after the previous one's verdict: the
// fallback of a refused call keeps the group's order.
func (b *Batcher) acceptInOrder(p *pendingAccept) {
	out := make([]Verdict, 0, len(p.raws))
	defer func() {
		if r := recover(); r != nil {
			for len(out) < len(p.raws) {
				out = append(out, Verdict{Err: fmt.Errorf("accept_event panicked: %v", r)})
			}
			answer(p, out)
		}
	}()
	for _, raw := range p.raws {
		ok, msg, err := AcceptJSON(p.ctx, b.pool, raw)
		out = append(out, Verdict{ok, msg, err})
	}
	answer(p, out)
}

func countEvents(batch []*pendingAccept) int {
	n := 0
	for _, p := range batch {
		n += len(p.raws)
	}
	return n
}

// answer gives p its verdicts; a second answer is dropped (done holds one and nobody else sends).
func answer(p *pendingAccept, v []Verdict) {
	select {
	case p.done <- v:
	default:
	}
}

// callContext bounds a call by the batcher's timeout and by the earliest deadline of its events,
// so a call does not run on long after an owner gave up and answered "error:" (its cancellation
// still reaches the server a little later, so a commit in that moment remains possible).
func (b *Batcher) callContext(batch []*pendingAccept) (context.Context, context.CancelFunc) {
	deadline := time.Now().Add(b.timeout)
	for _, p := range batch {
		if d, ok := p.ctx.Deadline(); ok && d.Before(deadline) {
			deadline = d
		}
	}
	return context.WithDeadline(b.base, deadline)
}

const acceptBatchSQL = `SELECT ok, message, code FROM buzz.accept_events($1::jsonb, $2)`

// call runs one buzz.accept_events call. It returns an error only when PostgreSQL refused the
// call (a *pgconn.PgError: the transaction is rolled back, so the events may go again). A
// failure whose outcome is unknown (the connection or the context ended, rows that do not
// decode) answers every event of the call with an error instead: the call may have committed,
// and a second run would answer "duplicate:" where the first verdict was something else (a DM
// open's channel id) and emit an ephemeral event twice.
func (b *Batcher) call(ctx context.Context, batch []*pendingAccept) ([]Verdict, error) {
	var arr bytes.Buffer
	arr.WriteByte('[')
	total := 0
	for _, p := range batch {
		for _, raw := range p.raws {
			if total > 0 {
				arr.WriteByte(',')
			}
			arr.Write(raw)
			total++
		}
	}
	arr.WriteByte(']')
	read := 0 // rows read: after the last one, the next thing is the commit's outcome
	unknown := func(err error) ([]Verdict, error) {
		var pgErr *pgconn.PgError
		// An ERROR aborts the transaction, at any point. A FATAL after every row could have come
		// after the commit (a backend terminated just then): not known to be rolled back.
		if errors.As(err, &pgErr) && !(read == total && (pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC")) {
			return nil, err
		}
		return same(total, Verdict{Err: fmt.Errorf("accept_events: outcome unknown: %w", err)}), nil
	}
	rows, err := b.pool.Query(ctx, acceptBatchSQL, arr.String(), BatchLockWait.Milliseconds())
	if err != nil {
		return unknown(err)
	}
	defer rows.Close()
	out := make([]Verdict, 0, total)
	for rows.Next() {
		var ok bool
		var msg string
		var code *string
		if err := rows.Scan(&ok, &msg, &code); err != nil {
			return unknown(err)
		}
		read++
		switch {
		case code == nil:
			out = append(out, Verdict{OK: ok, Msg: canonicalResponse(msg)})
		default:
			m, isClient := clientMessage(*code, msg)
			if !isClient {
				// accept_events catches the client SQLSTATEs only (a test compares the lists):
				// a code it caught that the relay does not map is a version skew, not the client's.
				out = append(out, Verdict{Err: fmt.Errorf("accept_events: unmapped SQLSTATE %s: %s", *code, msg)})
				continue
			}
			out = append(out, Verdict{OK: false, Msg: m})
		}
	}
	// Rows come before the commit (at Sync): an error here may be the commit's own.
	if err := rows.Err(); err != nil {
		return unknown(err)
	}
	if len(out) != total {
		return unknown(errBatchShort)
	}
	return out, nil
}

type batchError string

func (e batchError) Error() string { return string(e) }

const (
	errBatchShort     batchError = "accept_events returned fewer rows than events"
	errBatchAbandoned batchError = "the batch's runner stopped before answering (a panic)"
	errNoTimeLeft     batchError = "accept_events: the event waited for a call until too little time was left"
)
