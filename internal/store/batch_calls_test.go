package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

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

// A full batch of plain events (stored set-based) waits for the running call instead of starting
// another: verifying them costs the relay as much CPU as storing them costs PostgreSQL, so a
// second call would only slow the first.
//
//	s1: a first event's call stops before it runs (held)
//	s2: a group of four plain events queues: a full batch, and no second call starts
//	s3: the first call goes on; the next call runs all four
func TestBatcherRunsFullBatchesOfPlainEventsOneCallAtATime(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 4, 2)
	u := testenv.NewUser()
	first := h.hold(u) // s1
	var evs []*nostr.Event
	var keys []string
	for i := range 4 {
		ev := u.Event(t, 1, nil, fmt.Sprint("plain ", i))
		evs, keys = append(evs, ev), append(keys, ev.ID)
	}
	group := h.sendGroup(evs, keys) // s2
	h.waitQueued(4)
	if n := h.Running(); n != 1 {
		t.Fatalf("%d calls running with a full batch of plain events waiting, want 1", n)
	}
	close(h.release) // s3
	if v := wait(t, first, "first"); !v.ok || v.err != nil {
		t.Fatalf("first: %+v", v)
	}
	select {
	case vs := <-group:
		for i, v := range vs {
			if !v.OK || v.Err != nil {
				t.Fatalf("event %d: %+v", i, v)
			}
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the plain group was never answered")
	}
	if sizes := h.callSizes(); len(sizes) != 2 || sizes[1] != 4 {
		t.Fatalf("call sizes %v, want the held call then one of 4", sizes)
	}
}
