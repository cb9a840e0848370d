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

// sendGroup starts one AcceptGroup and returns where its verdicts will arrive.
func (h *heldBatcher) sendGroup(evs []*nostr.Event, keys []string) <-chan []store.Verdict {
	raws := make([][]byte, len(evs))
	for i, ev := range evs {
		raws[i], _ = json.Marshal(ev)
	}
	out := make(chan []store.Verdict, 1)
	go func() { out <- h.AcceptGroup(context.Background(), raws, keys) }()
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
