package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// While a call runs, a second one starts only once a full batch waits: a steady trickle keeps
// one call at a time (bigger batches, less CPU per event), a flood gets a second call.
//
//	s1: a first event's call stops before it runs (held)
//	s2: three events queue (3 < a batch of 4): no second call starts
//	s3: a fourth queues: a second call runs all four and answers them while the first is held
//	s4: the first call goes on
func TestBatcherStartsAnotherCallOnlyForAFullBatch(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 4, 2)
	u := testenv.NewUser()
	first := h.hold(u) // s1
	var waiting []<-chan verdictOf
	for i := range 3 { // s2
		waiting = append(waiting, h.send(context.Background(), u.Event(t, 1, nil, fmt.Sprint("trickle ", i))))
	}
	h.waitQueued(3)
	if n := h.Running(); n != 1 {
		t.Fatalf("%d calls running with 3 of 4 events waiting, want 1", n)
	}
	waiting = append(waiting, h.send(context.Background(), u.Event(t, 1, nil, "fills the batch"))) // s3
	for i, ch := range waiting {
		if v := wait(t, ch, "queued event"); !v.ok || v.err != nil {
			t.Fatalf("event %d: %+v", i, v)
		}
	}
	if sizes := h.callSizes(); len(sizes) != 2 || sizes[1] != 4 {
		t.Fatalf("call sizes %v, want the held call then one of 4", sizes)
	}
	close(h.release) // s4
	if v := wait(t, first, "first"); !v.ok || v.err != nil {
		t.Fatalf("first: %+v", v)
	}
}
