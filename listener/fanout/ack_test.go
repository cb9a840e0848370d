package fanout

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// commitProbe is a test_decoding slot on the harness's database: its COMMIT rows carry each
// transaction's end LSN, exactly what pgoutput's Commit message carries as TransactionEndLSN and
// what the fan-out acknowledges once that transaction was handed over.
type commitProbe struct {
	h    *harness
	name string
}

func newProbe(t testing.TB, h *harness) *commitProbe {
	t.Helper()
	name := fmt.Sprintf("fanprobe_%d", time.Now().UnixNano()%1e12)
	if _, err := h.pool.Exec(context.Background(), `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, name); err != nil {
		t.Fatalf("create probe slot: %v", err)
	}
	t.Cleanup(func() { h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, name) })
	return &commitProbe{h, name}
}

// acceptTxn stores ev through accept_event in its own transaction and returns that transaction's
// end LSN (read from the probe slot, which the probe only peeks at).
func (p *commitProbe) acceptTxn(t testing.TB, ev *nostr.Event) pglogrepl.LSN {
	t.Helper()
	ctx := context.Background()
	tx, err := p.h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	b, _ := json.Marshal(ev)
	var ok bool
	var msg, xid string
	if err := tx.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(b)).Scan(&ok, &msg); err != nil || !ok {
		t.Fatalf("accept_event: %v %v %q", err, ok, msg)
	}
	if err := tx.QueryRow(ctx, `SELECT (pg_current_xact_id()::text::bigint & 4294967295)::text`).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var lsn string
	if err := p.h.pool.QueryRow(ctx, `SELECT lsn::text FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'include-xids', '1')
		WHERE data = 'COMMIT ' || $2`, p.name, xid).Scan(&lsn); err != nil {
		t.Fatalf("commit LSN of xid %s from the probe slot: %v", xid, err)
	}
	end, err := pglogrepl.ParseLSN(lsn)
	if err != nil {
		t.Fatal(err)
	}
	return end
}

func (h *harness) confirmedFlush(t testing.TB, slot string) pglogrepl.LSN {
	t.Helper()
	var s *string
	if err := h.pool.QueryRow(context.Background(), `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&s); err != nil {
		t.Fatalf("slot %s: %v", slot, err)
	}
	if s == nil {
		return 0
	}
	lsn, _ := pglogrepl.ParseLSN(*s)
	return lsn
}

// sentLSN is how far the instance's walsender has sent the stream (pg_stat_replication.sent_lsn).
func (h *harness) sentLSN(instance string) pglogrepl.LSN {
	var s *string
	_ = h.pool.QueryRow(context.Background(), `SELECT sent_lsn::text FROM pg_stat_replication WHERE application_name = $1`,
		ApplicationName(instance)).Scan(&s)
	if s == nil {
		return 0
	}
	lsn, _ := pglogrepl.ParseLSN(*s)
	return lsn
}

// The fan-out acknowledges an LSN only after the events up to it were handed to the sink
// (docs/design.md, fan-out): while the sink holds an event, the slot's confirmed_flush_lsn stays below the
// end of that event's transaction, although the walsender sent that transaction and a later one
// and the stream acknowledges every 10 ms when it is free to; once the hand-off returns, the
// position passes both. Acknowledging what was received rather than what was handed over would
// let a crash of this process lose the held event for its subscribers.
func TestFanoutAcknowledgesOnlyWhatWasHandedOver(t *testing.T) {
	const statusEvery = 10 * time.Millisecond
	h := newHarness(t)
	probe := newProbe(t, h)
	sink := newRecSink()
	entered := make(chan struct{})
	release := make(chan struct{})
	sink.onDeliver = func(d delivery) {
		if d.Event.Content != "held" {
			return
		}
		close(entered)
		<-release
	}
	inst := instanceID("ack")
	f, _ := h.start(Config{InstanceID: inst, StatusInterval: statusEvery}, sink, nil)
	released := false
	t.Cleanup(func() { // before the harness closes the fan-out (cleanups are LIFO)
		if !released {
			close(release)
		}
	})

	// Acknowledgements flow: the slot passes a delivered transaction's end.
	warm := signedEvent(1, "warm", nil)
	warmEnd := probe.acceptTxn(t, warm)
	sink.waitAll(t, []string{warm.ID}, 20*time.Second)
	testenv.WaitUntil(t, 20*time.Second, "slot confirmed past a delivered transaction", func() bool {
		return h.confirmedFlush(t, f.slot) >= warmEnd
	})

	held := signedEvent(1, "held", nil)
	heldEnd := probe.acceptTxn(t, held)
	select {
	case <-entered:
	case <-time.After(20 * time.Second):
		t.Fatal("the held event never reached the sink")
	}
	after := signedEvent(1, "after", nil)
	afterEnd := probe.acceptTxn(t, after)
	// Barrier: the walsender has sent both transactions, so this process has received (or could
	// read) everything about the held one, its commit included.
	testenv.WaitUntil(t, 20*time.Second, "walsender sent past the later transaction", func() bool {
		return h.sentLSN(inst) >= afterEnd
	})
	// No notice can come from a stream that waits for its sink, so this part is a window: 100
	// acknowledgement intervals in which the slot must stay below the held transaction's end.
	for i := 0; i < 100; i++ {
		if c := h.confirmedFlush(t, f.slot); c >= heldEnd {
			t.Fatalf("slot confirmed %s while the event of the transaction ending at %s was still being handed over (I6/fan-out: acknowledged before hand-off)", c, heldEnd)
		}
		if n := sink.count(after.ID); n != 0 {
			t.Fatalf("the later event was handed over while the earlier one was held")
		}
		time.Sleep(statusEvery)
	}

	released = true
	close(release)
	sink.waitAll(t, []string{held.ID, after.ID}, 20*time.Second)
	testenv.WaitUntil(t, 20*time.Second, "slot confirmed past both transactions after the hand-off", func() bool {
		return h.confirmedFlush(t, f.slot) >= afterEnd
	})
	sink.assertExactlyOnce(t, []string{warm.ID, held.ID, after.ID})
}
