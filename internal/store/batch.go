package store

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// MaxBatch is the most events one buzz.accept_events call takes (sql/0028: one subtransaction
// each, and PostgreSQL caches 64 subtransaction ids per backend).
const MaxBatch = 60

// BatchLockWait bounds every lock wait of a call made while holding a batch slot. A call that
// waits longer (a lock held by an operator's open transaction, two batches locking the same rows
// in opposite orders) gives up with 55P03 and its events are stored one by one outside the
// slots, as without batching: no slot is held for long, so one blocked event never stalls the
// others.
const BatchLockWait = 50 * time.Millisecond

// Batcher stores events as AcceptJSON does, but groups the ones that arrive while earlier calls
// are running into one buzz.accept_events call: one transaction, one WAL flush and one walsender
// wake-up for all of them (group commit). There is no background goroutine: a caller whose event
// is still queued takes a free slot and runs the queue's head itself, so an idle relay runs each
// event at once and a busy one runs bigger batches.
//
// Every event still gets the verdict accept_event gives it alone: each runs in its own
// subtransaction, and a call that fails for any reason but a client error is retried event by
// event (AcceptJSON, with its deadlock retries).
type Batcher struct {
	pool    *pgxpool.Pool
	max     int
	slots   chan struct{}
	timeout time.Duration

	mu    sync.Mutex
	queue []*pendingAccept

	// onBatch, when set (in-package tests), is called with each call's size before it runs,
	// holding the slot: a test can stop a call there and let events queue behind it.
	onBatch func(n int)
}

type pendingAccept struct {
	ctx   context.Context
	raw   []byte
	taken bool // in a batch: its owner waits for done and takes no slot (guarded by Batcher.mu)
	done  chan acceptVerdict
}

type acceptVerdict struct {
	ok  bool
	msg string
	err error
}

// NewBatcher returns a Batcher running at most inflight calls at once (each on its own pool
// connection), of at most maxEvents events each (capped at MaxBatch). maxEvents 1 turns batching
// off: Accept is then AcceptJSON. timeout bounds one call.
func NewBatcher(pool *pgxpool.Pool, maxEvents, inflight int, timeout time.Duration) *Batcher {
	maxEvents = min(max(maxEvents, 1), MaxBatch)
	return &Batcher{pool: pool, max: maxEvents, slots: make(chan struct{}, max(inflight, 1)), timeout: timeout}
}

// Accept stores one verified event and returns its OK verdict, as AcceptJSON.
func (b *Batcher) Accept(ctx context.Context, raw []byte) (ok bool, message string, err error) {
	if b.max == 1 {
		return AcceptJSON(ctx, b.pool, raw)
	}
	p := &pendingAccept{ctx: ctx, raw: raw, done: make(chan acceptVerdict, 1)}
	b.mu.Lock()
	b.queue = append(b.queue, p)
	b.mu.Unlock()
	for {
		b.mu.Lock()
		slot := b.slots
		if p.taken {
			slot = nil // someone runs it: wait for the verdict, do not spin on free slots
		}
		b.mu.Unlock()
		select {
		case v := <-p.done:
			return v.ok, v.msg, v.err
		case <-ctx.Done():
			// Still queued: the next runner drops it. Taken: its verdict is dropped.
			return false, "", ctx.Err()
		case slot <- struct{}{}:
			b.runNext()
			<-b.slots
		}
	}
}

// runNext runs the queue's head (up to b.max events) as one call, holding a slot.
func (b *Batcher) runNext() {
	b.mu.Lock()
	var batch []*pendingAccept
	n := 0
	for n < len(b.queue) && len(batch) < b.max {
		p := b.queue[n]
		n++
		if p.ctx.Err() != nil {
			continue // its owner has gone
		}
		p.taken = true
		batch = append(batch, p)
	}
	b.queue = b.queue[n:]
	if len(b.queue) == 0 {
		b.queue = nil // let the backing array go
	}
	b.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	metrics.AcceptBatchEvents.Observe(float64(len(batch)))
	if b.onBatch != nil {
		b.onBatch(len(batch))
	}
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	verdicts, err := b.call(ctx, batch)
	if err != nil {
		// Nothing of the call is committed. Each event goes again on its own, outside the slots,
		// waiting for locks as long as its own context lets it.
		metrics.AcceptBatchFallbacks.WithLabelValues(fallbackReason(err)).Inc()
		for _, p := range batch {
			go func() {
				ok, msg, err := AcceptJSON(p.ctx, b.pool, p.raw)
				p.done <- acceptVerdict{ok, msg, err}
			}()
		}
		return
	}
	for i, p := range batch {
		p.done <- verdicts[i]
	}
}

const acceptBatchSQL = `SELECT ok, message, code FROM buzz.accept_events($1::jsonb, $2)`

// call runs one buzz.accept_events call; err is non-nil when the call as a whole failed.
func (b *Batcher) call(ctx context.Context, batch []*pendingAccept) ([]acceptVerdict, error) {
	var arr bytes.Buffer
	arr.WriteByte('[')
	for i, p := range batch {
		if i > 0 {
			arr.WriteByte(',')
		}
		arr.Write(p.raw)
	}
	arr.WriteByte(']')
	rows, err := b.pool.Query(ctx, acceptBatchSQL, arr.String(), BatchLockWait.Milliseconds())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := make([]acceptVerdict, 0, len(batch))
	for rows.Next() {
		var ok bool
		var msg string
		var code *string
		if err := rows.Scan(&ok, &msg, &code); err != nil {
			return nil, err
		}
		switch {
		case code == nil:
			out = append(out, acceptVerdict{ok: ok, msg: canonicalResponse(msg)})
		default:
			m, isClient := clientMessage(*code, msg)
			if !isClient {
				// accept_events only catches client SQLSTATEs; anything else is a mismatch
				// between its list and ours, so store these events one by one instead.
				return nil, errBatchCodeUnknown
			}
			out = append(out, acceptVerdict{ok: false, msg: m})
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if len(out) != len(batch) {
		return nil, errBatchShort
	}
	return out, nil
}

type batchError string

func (e batchError) Error() string { return string(e) }

const (
	errBatchCodeUnknown batchError = "accept_events returned an SQLSTATE the relay does not map"
	errBatchShort       batchError = "accept_events returned fewer rows than events"
)

// fallbackReason labels a failed call: its SQLSTATE (55P03 lock wait, 40P01 deadlock, ...),
// "timeout", or "other".
func fallbackReason(err error) string {
	if s := db.SQLState(err); s != "" {
		return s
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return "timeout"
	}
	return "other"
}
