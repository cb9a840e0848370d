package store_test

import (
	"context"
	"encoding/json"
	"fmt"
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
	go func() { out <- h.AcceptGroup(context.Background(), store.Group{Since: since, Raws: raws, Keys: keys}) }()
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

// sendGrowing starts one AcceptGroup whose Grow hands over more, once, as long as they fit: the
// events its connection read meanwhile, the first specialMore of them special. It records the
// readBy it was asked with.
func (h *heldBatcher) sendGrowing(since time.Time, evs, more []*nostr.Event, special, specialMore int) (<-chan []store.Verdict, func() time.Time) {
	raws := make([][]byte, len(evs))
	for i, ev := range evs {
		raws[i], _ = json.Marshal(ev)
	}
	var readBy time.Time
	grow := func(fit func(bool) bool, by time.Time) (out [][]byte, keys []string, sp int) {
		readBy = by
		for i, ev := range more {
			if !fit(i < specialMore) {
				break
			}
			raw, _ := json.Marshal(ev)
			out, keys = append(out, raw), append(keys, "")
			if i < specialMore {
				sp++
			}
		}
		more = nil
		return out, keys, sp
	}
	out := make(chan []store.Verdict, 1)
	g := store.Group{Since: since, Raws: raws, Keys: make([]string, len(evs)), Special: special, Grow: grow}
	go func() { out <- h.AcceptGroup(context.Background(), g) }()
	return out, func() time.Time { return readBy }
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
	group, _ := h.sendGrowing(time.Now(), []*nostr.Event{a}, []*nostr.Event{b, c, d}, 0, 0)
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
	x, asked := h.sendGrowing(t0, []*nostr.Event{u.Event(t, 1, nil, "x")}, nil, 0, 0)
	h.waitQueued(1)
	y := h.sendGroupReadAt(t0.Add(time.Second), []*nostr.Event{u.Event(t, 1, nil, "y1"), u.Event(t, 1, nil, "y2"),
		u.Event(t, 1, nil, "y3")}, []string{"", "", ""})
	h.waitQueued(4)
	close(h.release)
	wait(t, first, "first")
	wait(t, x, "x")
	wait(t, y, "y")
	if readBy := asked(); !readBy.Equal(t0.Add(time.Second)) {
		t.Fatalf("grow asked for events read by %v, want %v (the queued group's first read)", readBy, t0.Add(time.Second))
	}
}

// kind1s are n kind 1 events of u.
func kind1s(t *testing.T, u testenv.User, n int) []*nostr.Event {
	evs := make([]*nostr.Event, n)
	for i := range evs {
		evs[i] = u.Event(t, 1, nil, fmt.Sprint(i))
	}
	return evs
}

// A call of more than 60 events keeps its subtransactions within 60: one per special event (not
// stored set-based) and one per run between them, so past 60 events it takes at most 29 special
// ones. A group too special to fit whole goes in calls of 60.
func TestBatcherKeepsACallWithinSixtySubtransactions(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 120, 1)
	u := testenv.NewUser()
	first := h.hold(u)
	special := h.sendGroupSpecial(kind1s(t, u, 50), 50)
	h.waitQueued(50)
	plain := h.sendGroupSpecial(kind1s(t, u, 20), 0)
	h.waitQueued(70)
	whole := h.sendGroupSpecial(kind1s(t, u, 100), 100)
	h.waitQueued(130) // the big group's first 60: the other 40 follow once they are stored
	close(h.release)
	wait(t, first, "first")
	for _, g := range []<-chan []store.Verdict{special, plain, whole} {
		for i, v := range wait(t, g, "group") {
			if !v.OK || v.Err != nil {
				t.Fatalf("event %d: %+v", i, v)
			}
		}
	}
	if sizes := h.callSizes(); !slices.Equal(sizes, []int{1, 50, 20, 60, 40}) {
		t.Fatalf("calls of %v events, want [1 50 20 60 40]", sizes)
	}
}

// A group grows past 60 events only by as many special ones as keep the call within 60
// subtransactions.
func TestBatcherGrowsAGroupWithinSixtySubtransactions(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcherOf(t, url, 120, 1)
	u := testenv.NewUser()
	first := h.hold(u)
	group, _ := h.sendGrowing(time.Now(), kind1s(t, u, 10), kind1s(t, u, 100), 0, 100)
	h.waitQueued(10)
	close(h.release)
	wait(t, first, "first")
	if v := wait(t, group, "grown group"); len(v) != 60 {
		t.Fatalf("%d verdicts, want 60: the group and 50 special events (10 + 50 = 60 subtransactions at most)", len(v))
	}
}

// sendGroupSpecial starts one AcceptGroup of evs, special of them special (store.Group.Special).
func (h *heldBatcher) sendGroupSpecial(evs []*nostr.Event, special int) <-chan []store.Verdict {
	raws := make([][]byte, len(evs))
	for i, ev := range evs {
		raws[i], _ = json.Marshal(ev)
	}
	out := make(chan []store.Verdict, 1)
	g := store.Group{Since: time.Now(), Raws: raws, Keys: make([]string, len(evs)), Special: special}
	go func() { out <- h.AcceptGroup(context.Background(), g) }()
	return out
}
