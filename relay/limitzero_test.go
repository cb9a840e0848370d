package relay

import (
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// An event the initial query sent is not sent again live because it also matches a filter with
// limit 0 (docs/protocol.md: at most once per subscription). The replication tail delivers it after
// the rows are out: committed before the query's snapshot, so the snapshot saw it.
func TestRowAlsoMatchingALimitZeroFilterIsNotSentAgainLive(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, 1)
	c := tr.dial(t)
	sameIDs(t, "initial answer", c.req("s", nostr.Filter{Authors: []string{pk}},
		nostr.Filter{Authors: []string{pk}, LimitZero: true}), evs[0])
	if snap := subSnapshot(tr, "s"); snap == nil || !snap.sees(xid) {
		t.Fatal("test premise: the query's snapshot saw the event")
	}
	tr.s.DeliverEvent(storedDelivery(&evs[0], xid))
	sentinel, sxid := storeRows(t, tr, pk, 1)
	tr.s.DeliverEvent(storedDelivery(&sentinel[0], sxid))
	if got := c.nextEvent("s"); got.ID != sentinel[0].ID {
		t.Fatalf("next live event %s, want the sentinel %s (the answered row was sent twice)", got.ID[:8], sentinel[0].ID[:8])
	}
}

// The limit-0 filter still gets, live, an event the snapshot saw that the queried filter passed
// over (beyond its limit): that filter answered it, the limit-0 one did not.
func TestLimitZeroFilterGetsWhatTheQueriedFilterPassedOver(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, 3) // newest first
	c := tr.dial(t)
	sameIDs(t, "initial answer", c.req("s", nostr.Filter{Authors: []string{pk}, Limit: 1},
		nostr.Filter{Authors: []string{pk}, LimitZero: true}), evs[0])
	tr.s.DeliverEvent(storedDelivery(&evs[0], xid)) // answered: not again
	sentLive(t, tr, c, "s", &evs[2], xid)           // passed over: live for the limit-0 filter
	tr.s.DeliverEvent(storedDelivery(&evs[2], xid)) // and only once
	sentinel, sxid := storeRows(t, tr, pk, 1)
	sentLive(t, tr, c, "s", &sentinel[0], sxid)
}

// Past the row ids kept for limit-0 filters (sentRowsMax), an answered event is still not sent
// twice: one that cannot be told apart counts as sent.
func TestRowsBeyondTheKeptIdsAreNotSentAgainLive(t *testing.T) {
	tr := startRelay(t, nil)
	_, pk := testenv.NewKey()
	evs, xid := storeRows(t, tr, pk, sentRowsMax+50)
	c := tr.dial(t)
	if got := c.req("s", nostr.Filter{Authors: []string{pk}, Limit: len(evs)},
		nostr.Filter{Authors: []string{pk}, LimitZero: true}); len(got) != len(evs) {
		t.Fatalf("initial answer has %d rows, want %d", len(got), len(evs))
	}
	for i := range evs {
		tr.s.DeliverEvent(storedDelivery(&evs[i], xid))
	}
	sentinel, sxid := storeRows(t, tr, pk, 1)
	sentLive(t, tr, c, "s", &sentinel[0], sxid)
}
