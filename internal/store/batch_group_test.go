package store_test

import (
	"context"
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// sendGroup starts one AcceptGroup of events read now and returns where its verdicts will arrive.
func (h *heldBatcher) sendGroup(evs []*nostr.Event, keys []string) <-chan []store.Verdict {
	return h.sendGroupReadAt(time.Now(), evs, keys)
}

// sendGroupReadAt is sendGroup for events whose oldest was read at since.
func (h *heldBatcher) sendGroupReadAt(since time.Time, evs []*nostr.Event, keys []string) <-chan []store.Verdict {
	raws := make([][]byte, len(evs))
	for i, ev := range evs {
		raws[i], _ = json.Marshal(ev)
	}
	out := make(chan []store.Verdict, 1)
	go func() { out <- h.AcceptGroup(context.Background(), since, raws, keys, nil) }()
	return out
}

// A group keeps its order inside a call: groups, not events, are sorted by lock key (by the
// group's smallest key), so a connection's events stay in the order it sent them.
func TestBatcherKeepsAGroupTogetherAndInOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	keyOrders := h.recordKeyOrders()
	u := testenv.NewUser()
	first := h.hold(u)
	single := h.sendGroup([]*nostr.Event{u.Event(t, 1, nil, "m")}, []string{"m"})
	h.waitQueued(1)
	group := h.sendGroup([]*nostr.Event{u.Event(t, 1, nil, "z"), u.Event(t, 1, nil, "a")}, []string{"z", "a"})
	h.waitQueued(3)
	close(h.release)
	wait(t, first, "first")
	if v := wait(t, single, "single")[0]; !v.OK || v.Err != nil {
		t.Fatalf("single: %+v", v)
	}
	for i, v := range wait(t, group, "group") {
		if !v.OK || v.Err != nil {
			t.Fatalf("group event %d: %+v", i, v)
		}
	}
	orders := keyOrders()
	if want := []string{"z", "a", "m"}; len(orders) != 2 || !slices.Equal(orders[1], want) {
		t.Fatalf("calls ran in key orders %q, want the second %q", orders, want)
	}
}

// Queued groups go oldest first, by when their first event was read, not by when they reached the
// queue: a connection's group waited in its window while the connection's previous group was
// stored (relay/pipeline.go), and must not wait again behind groups read after it.
func TestBatcherTakesTheOldestGroupFirst(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 2, 1)
	keyOrders := h.recordKeyOrders()
	u := testenv.NewUser()
	first := h.hold(u)
	now := time.Now()
	late := h.sendGroupReadAt(now, []*nostr.Event{u.Event(t, 1, nil, "l1"), u.Event(t, 1, nil, "l2")}, []string{"l1", "l2"})
	h.waitQueued(2)
	early := h.sendGroupReadAt(now.Add(-time.Second), []*nostr.Event{u.Event(t, 1, nil, "e1"), u.Event(t, 1, nil, "e2")},
		[]string{"e1", "e2"})
	h.waitQueued(4)
	close(h.release)
	wait(t, first, "first")
	wait(t, early, "early group")
	wait(t, late, "late group")
	orders := keyOrders()
	if want := [][]string{{"e1", "e2"}, {"l1", "l2"}}; len(orders) != 3 || !slices.EqualFunc(orders[1:], want, slices.Equal) {
		t.Fatalf("calls ran in key orders %q, want %q after the first", orders, want)
	}
}

// When PostgreSQL refuses a call, a group's events go again one by one in their order: a later
// event of the group is not answered (not stored) while an earlier one waits for a lock.
func TestBatcherFallbackKeepsAGroupInOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	locker := lockProfile(t, url, u.PK)
	first := h.hold(u)
	profile := u.Event(t, 0, nil, `{"name":"blocked"}`)
	a, b := u.Event(t, 1, nil, "a"), u.Event(t, 1, nil, "b")
	group := h.sendGroup([]*nostr.Event{profile, a, b}, []string{"", "", ""})
	h.waitQueued(3)
	close(h.release)
	wait(t, first, "first")
	time.Sleep(500 * time.Millisecond) // the refused call (50 ms lock wait) and its fallback
	select {
	case v := <-group:
		t.Fatalf("the group was answered while its first event's lock is held: %+v", v)
	default:
	}
	if n := storedCount(t, url, a.ID, b.ID); n != 0 {
		t.Fatalf("%d later events of the group stored before the first", n)
	}
	locker.Commit()
	for i, v := range wait(t, group, "group after the lock went") {
		if !v.OK || v.Msg != "" || v.Err != nil {
			t.Fatalf("group event %d: %+v", i, v)
		}
	}
}

// sendGrowing starts one AcceptGroup whose Grow hands over more, once: the events its connection
// read meanwhile. It records the room and readBy it was asked with.
func (h *heldBatcher) sendGrowing(since time.Time, evs, more []*nostr.Event) (<-chan []store.Verdict, func() (int, time.Time)) {
	raws := make([][]byte, len(evs))
	for i, ev := range evs {
		raws[i], _ = json.Marshal(ev)
	}
	var room int
	var readBy time.Time
	grow := func(r int, by time.Time) ([][]byte, []string) {
		room, readBy = r, by
		var out [][]byte
		for _, ev := range more[:min(r, len(more))] {
			raw, _ := json.Marshal(ev)
			out = append(out, raw)
		}
		more = nil
		return out, make([]string, len(out))
	}
	out := make(chan []store.Verdict, 1)
	go func() { out <- h.AcceptGroup(context.Background(), since, raws, make([]string, len(evs)), grow) }()
	return out, func() (int, time.Time) { return room, readBy }
}

// A group that waited for a call takes along, in the same call and after its own events, what its
// connection read meanwhile: one call where there would have been two, the second only after the
// first's commit.
func TestBatcherGrowsAGroupWhenACallTakesIt(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 4, 1)
	u := testenv.NewUser()
	first := h.hold(u)
	a, b, c, d := u.Event(t, 1, nil, "a"), u.Event(t, 1, nil, "b"), u.Event(t, 1, nil, "c"), u.Event(t, 1, nil, "d")
	group, asked := h.sendGrowing(time.Now(), []*nostr.Event{a}, []*nostr.Event{b, c, d})
	h.waitQueued(1)
	close(h.release)
	wait(t, first, "first")
	verdicts := wait(t, group, "grown group")
	if len(verdicts) != 4 {
		t.Fatalf("%d verdicts, want 4 (the group and the 3 events it grew by)", len(verdicts))
	}
	for i, v := range verdicts {
		if !v.OK || v.Msg != "" || v.Err != nil {
			t.Fatalf("event %d: %+v", i, v)
		}
	}
	if room, _ := asked(); room != 3 {
		t.Fatalf("grow asked for %d, want the call's room: 3", room)
	}
	if sizes := h.callSizes(); !slices.Equal(sizes, []int{1, 4}) {
		t.Fatalf("calls of %v events, want [1 4]", sizes)
	}
	if n := storedCount(t, url, a.ID, b.ID, c.ID, d.ID); n != 4 {
		t.Fatalf("%d of 4 stored", n)
	}
}

// A group grows only by events read before the oldest group left in the queue: the room left in
// a call does not let one connection's newer events jump another connection's older ones.
func TestBatcherGrowsAGroupOnlyByEventsOlderThanTheQueue(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 3, 1)
	u := testenv.NewUser()
	first := h.hold(u)
	t0 := time.Now().Add(-time.Minute)
	x, asked := h.sendGrowing(t0, []*nostr.Event{u.Event(t, 1, nil, "x")}, nil)
	h.waitQueued(1)
	y := h.sendGroupReadAt(t0.Add(time.Second), []*nostr.Event{u.Event(t, 1, nil, "y1"), u.Event(t, 1, nil, "y2"),
		u.Event(t, 1, nil, "y3")}, []string{"", "", ""})
	h.waitQueued(4)
	close(h.release)
	wait(t, first, "first")
	wait(t, x, "x")
	wait(t, y, "y")
	if room, readBy := asked(); room != 2 || !readBy.Equal(t0.Add(time.Second)) {
		t.Fatalf("grow asked for %d events read by %v, want 2 read by %v (the queued group's first read)",
			room, readBy, t0.Add(time.Second))
	}
}
