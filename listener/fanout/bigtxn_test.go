package fanout

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// The shape of a large transaction for these tests: many more deliveries than the id window, and
// rows padded so that what the walsender has sent ahead of a blocked sink (socket buffers: about
// 4.3 MiB measured on loopback) is far less than what follows the cut, so a kill lands inside the
// transaction. The padding compresses, so the WAL stays small while the wire carries all of it.
const (
	bigTxnWindow = 100   // DedupeWindow of the stream under test
	bigTxnRows   = 1500  // rows of the transaction
	bigTxnPad    = 16000 // bytes of content per row: ~24 MB on the wire in all
	bigTxnCutAt  = 300   // deliveries handed over before the stream breaks (~4.8 MB)
)

// bigTxnPrefix marks the rows of the large transaction (the sink hook counts them).
const bigTxnPrefix = "bigtxn:"

// storeBigTxn stores bigTxnRows events in one transaction, as an operator import calling
// accept_event many times does, and returns their ids in order.
func storeBigTxn(t *testing.T, h *harness) []string {
	t.Helper()
	ctx := context.Background()
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	pad := strings.Repeat("x", bigTxnPad)
	ids := make([]string, 0, bigTxnRows)
	for i := 0; i < bigTxnRows; i++ {
		ev := signedEvent(1, bigTxnPrefix+pad, nil)
		b, _ := ev.MarshalJSON()
		if _, err := tx.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(b)); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ev.ID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return ids
}

// cutSink blocks the stream at the bigTxnCutAt-th row of the large transaction until released.
type cutSink struct {
	*recSink
	n       int // rows of the large transaction seen; only the Run goroutine touches it
	reached chan struct{}
	release chan struct{}
}

func newCutSink() *cutSink {
	s := &cutSink{recSink: newRecSink(), reached: make(chan struct{}), release: make(chan struct{})}
	s.onDeliver = func(d delivery) {
		if !strings.HasPrefix(d.Event.Content, bigTxnPrefix) {
			return
		}
		if s.n++; s.n == bigTxnCutAt {
			close(s.reached)
			<-s.release
		}
	}
	return s
}

func (s *cutSink) waitReached(t *testing.T) {
	t.Helper()
	select {
	case <-s.reached:
	case <-time.After(60 * time.Second):
		t.Fatalf("the stream never handed over %d rows of the large transaction", bigTxnCutAt)
	}
}

// A transaction with more deliveries than the id window is cut off by a walsender kill after
// some of its rows were handed over; the server resends it whole after the reconnect. Every row
// is still delivered exactly once: the resend's first rows, long gone from the window, are
// skipped by their count.
func TestFanoutTransactionLargerThanWindowCutByWalsenderKill(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newCutSink()
	inst := instanceID("bigtxn")
	f, _ := h.start(Config{InstanceID: inst, StatusInterval: time.Hour, DedupeWindow: bigTxnWindow}, sink, nil)
	before := signedEvent(1, "before", nil)
	h.accept(ctx, before)
	sink.waitAll(t, []string{before.ID}, 20*time.Second)

	ids := storeBigTxn(t, h)
	sink.waitReached(t)
	// The sink holds the stream inside the transaction: end its walsender meanwhile, and let the
	// stream go on only once the walsender has stopped decoding, so the session breaks with the
	// rest of the transaction unsent. A walsender blocked on the full socket takes the signal at
	// once but then waits to send its FATAL to our blocked stream (wait event ClientWrite), so
	// that, or its exit, is the barrier.
	pid := h.walsenderPID(ctx, inst)
	if pid == 0 {
		t.Fatal("no walsender for the stream")
	}
	var ok bool
	if err := h.pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminate walsender %d: %v %v", pid, ok, err)
	}
	testenv.WaitUntil(t, 20*time.Second, "walsender gone or sending its FATAL", func() bool {
		var n int
		_ = h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE pid = $1 AND wait_event IS DISTINCT FROM 'ClientWrite'`, pid).Scan(&n)
		return n == 0
	})
	sessions := f.sessions.Load()
	close(sink.release)
	testenv.WaitUntil(t, 30*time.Second, "reattached", func() bool { return f.sessions.Load() > sessions && f.Ready() })

	// A last event after the transaction: once it is here, any duplicate would be too.
	after := signedEvent(1, "after", nil)
	h.accept(ctx, after)
	keys := append(append([]string{before.ID}, ids...), after.ID)
	sink.waitAll(t, keys, 60*time.Second)
	sink.assertExactlyOnce(t, keys)
	resent := f.skippedResent.Load()
	t.Logf("rows handed over before the break and skipped on the resend: %d; id window skips: %d", resent, f.skippedDup.Load())
	if resent < bigTxnCutAt || resent >= bigTxnRows {
		t.Fatalf("skipped %d resent rows, want at least %d and fewer than %d: the break did not land inside the transaction",
			resent, bigTxnCutAt, bigTxnRows)
	}
}

// A new process (this one crashed mid-transaction) must hand over the whole transaction: its
// connections never saw any of it. The count is in memory only, so a new Fanout on the same slot
// starts from nothing; the old one stopped inside the transaction without acknowledging it.
func TestFanoutNewProcessGetsATransactionCutOffWhole(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newCutSink()
	inst := instanceID("bigtxn_new")
	cfg := Config{InstanceID: inst, StatusInterval: time.Hour, DedupeWindow: bigTxnWindow}
	old, stop := h.start(cfg, sink, nil)
	ids := storeBigTxn(t, h)
	sink.waitReached(t)
	stop() // the old process ends while its sink holds the transaction
	close(sink.release)
	waitCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if old.runner.Stop(waitCtx) != nil { // Run was stopped already: this only waits for it to return
		t.Fatal("the old fan-out did not stop")
	}

	fresh := newRecSink()
	f, _ := h.start(cfg, fresh, nil)
	after := signedEvent(1, "after", nil)
	h.accept(ctx, after)
	keys := append(append([]string{}, ids...), after.ID)
	fresh.waitAll(t, keys, 60*time.Second)
	fresh.assertExactlyOnce(t, keys)
	if n := f.skippedResent.Load(); n != 0 {
		t.Fatalf("the new process skipped %d rows of a transaction its connections never saw", n)
	}
}
