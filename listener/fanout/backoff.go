package fanout

import (
	"context"
	"math/rand/v2"
	"time"
)

// stableSession is how long a replication session must have lasted for its end to start the
// reconnect backoff over at 100 ms.
const stableSession = 10 * time.Second

// backoff doubles from 100ms to a 5s cap, with jitter so processes that lost the server together
// do not come back in lockstep. sleep, when set (tests), is called with the undoubled base instead
// of waiting.
type backoff struct {
	d     time.Duration
	sleep func(base time.Duration) bool
}

func newBackoff() *backoff { return &backoff{d: 100 * time.Millisecond} }
func (b *backoff) reset()  { b.d = 100 * time.Millisecond }
func (b *backoff) wait(ctx context.Context) bool {
	base := b.d
	d := b.d/2 + time.Duration(rand.Int64N(int64(b.d/2)+1))
	if b.d *= 2; b.d > 5*time.Second {
		b.d = 5 * time.Second
	}
	if b.sleep != nil {
		return b.sleep(base) && ctx.Err() == nil
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
