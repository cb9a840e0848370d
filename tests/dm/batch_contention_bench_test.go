package dm

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// BenchmarkBatchesSharingDMs: two batchers (two relay processes' acceptance) take 16 senders'
// messages into the same 4 DMs. A DM message locks its DM's member rows until its call commits
// (buzz.lock_dm), so calls that ran their events in arrival order held one DM each and waited for
// the other's, until the 50 ms lock wait bound sent both calls back to single events. Calls run
// their events in channel order (store.Batcher.Accept's lockKey). Reports messages/s and
// fallbacks per run.
//
//	go test ./tests/dm -run '^$' -bench BatchesSharingDMs -benchtime 5x
func BenchmarkBatchesSharingDMs(b *testing.B) {
	e := newEnv(b)
	users := make([]user, 8)
	for i := range users {
		users[i] = newUser()
	}
	var chans []string
	for i := 0; i < len(users); i += 2 {
		chans = append(chans, e.open(users[i], users[i+1]))
	}
	procs := []*store.Batcher{
		store.NewBatcher(context.Background(), testenv.Pool(b, e.url), 32, 1, 15*time.Second),
		store.NewBatcher(context.Background(), testenv.Pool(b, e.url), 32, 1, 15*time.Second),
	}
	const senders, perSender = 16, 60
	var msgs, fallbacks float64
	var took time.Duration
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		evs := make([][][]byte, senders) // signed before the clock starts
		for w := range evs {
			for i := range perSender {
				c := (w + i) % len(chans)
				raw, _ := json.Marshal(users[2*c].Event(b, 9, nostr.Tags{{"h", chans[c]}}, ""))
				evs[w] = append(evs[w], raw)
			}
		}
		before := testenv.CounterTotal(b, "buzz_accept_batch_fallbacks_total")
		b.StartTimer()
		start := time.Now()
		var wg sync.WaitGroup
		for w := range senders {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i, raw := range evs[w] {
					c := (w + i) % len(chans)
					if ok, msg, err := procs[w%2].Accept(context.Background(), raw, chans[c]); err != nil || !ok {
						b.Errorf("accept: %v %q %v", ok, msg, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		took += time.Since(start)
		msgs += senders * perSender
		fallbacks += testenv.CounterTotal(b, "buzz_accept_batch_fallbacks_total") - before
	}
	b.ReportMetric(msgs/took.Seconds(), "msgs/s")
	b.ReportMetric(fallbacks/float64(b.N), "fallbacks/run")
}
