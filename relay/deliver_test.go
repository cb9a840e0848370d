package relay

import (
	"strconv"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// NIP-40 on the live path: an event that expired while it travelled through replication (lag) is
// not delivered; one that is still valid is. Deliveries reach a connection in order, so the first
// event the subscription sees tells which ones went out.
func TestLiveDeliverySkipsExpiredEvents(t *testing.T) {
	tr := startRelay(t, nil)
	sk, pk := testenv.NewKey()
	c := tr.dial(t)
	c.req("live", nostr.Filter{Authors: []string{pk}})
	now := nostr.Now()
	exp := func(at nostr.Timestamp) nostr.Tag { return nostr.Tag{"expiration", strconv.FormatInt(int64(at), 10)} }
	gone := signed(sk, 1, "expired in transit", now-5, exp(now-1))
	tr.s.DeliverEvent(publicDelivery(&gone))
	fresh := signed(sk, 1, "still valid", now-5, exp(now+3600))
	tr.s.DeliverEvent(publicDelivery(&fresh))
	if got := c.nextEvent("live"); got.ID != fresh.ID {
		t.Fatalf("first live event %q, want %q", got.Content, fresh.Content)
	}
}
