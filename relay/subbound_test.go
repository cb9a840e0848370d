package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// subBound drives a bound on live subscriptions (an ipSlots) with REQs and reads what it holds:
// what TestSubscriptionsPerIP and TestSubscriptionsPerProcess share.
type subBound struct {
	t       *testing.T
	slots   *ipSlots
	label   string // its bound in buzz_subscriptions_refused_total
	prefix  string // of the CLOSED reason a REQ over it gets
	refused float64
}

// subStep is one REQ and whether the bound refuses it.
type subStep struct {
	c      *client
	id     string
	closed bool
}

func newSubBound(t *testing.T, slots *ipSlots, label, prefix string) *subBound {
	return &subBound{t: t, slots: slots, label: label, prefix: prefix,
		refused: testutil.ToFloat64(metrics.SubscriptionsRefused.WithLabelValues(label))}
}

// open sends a REQ (kind 1, limit 1) and returns its CLOSED reason, "" when it stays open.
func (b *subBound) open(c *client, id string) string {
	b.t.Helper()
	_, closed := c.reqOrClosed(id, nostr.Filter{Kinds: []int{1}, Limit: 1})
	return closed
}

// steps sends each REQ in turn and checks that the bound refused it or not, as the step says.
func (b *subBound) steps(steps ...subStep) {
	b.t.Helper()
	for _, step := range steps {
		got := b.open(step.c, step.id)
		if step.closed != (got != "") || (got != "" && !strings.HasPrefix(got, b.prefix)) {
			b.t.Fatalf("REQ %s: CLOSED %q, want closed %v", step.id, got, step.closed)
		}
	}
}

// refusals is how many REQs the bound has refused since newSubBound.
func (b *subBound) refusals() float64 {
	return testutil.ToFloat64(metrics.SubscriptionsRefused.WithLabelValues(b.label)) - b.refused
}

func (b *subBound) held(key string) int {
	b.slots.mu.Lock()
	defer b.slots.mu.Unlock()
	return b.slots.held[key]
}

// waitHeld waits until key holds n places.
func (b *subBound) waitHeld(key string, n int) {
	b.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); b.held(key) != n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			b.t.Fatalf("%q holds %d places, want %d", key, b.held(key), n)
		}
	}
}
