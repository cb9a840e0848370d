package relay

import "testing"

// BenchmarkSendQueueOffer: what counting against the shared send budget adds to a live push and
// its write (offer, take, written) on two cores, against queues that count nothing, same run.
//
//	go test ./relay -run '^$' -bench SendQueueOffer
func BenchmarkSendQueueOffer(b *testing.B) {
	msg := make([]byte, 600)
	for _, counted := range []bool{false, true} {
		name := "alone"
		if counted {
			name = "budget"
		}
		b.Run(name, func(b *testing.B) {
			budget := newSendBudget(1<<30, 1<<28)
			b.RunParallel(func(pb *testing.PB) {
				// A queue per goroutine (a connection each), one budget and client for all: the
				// shared counts are what the goroutines contend on.
				q := newSendQueue(4 << 20)
				if counted {
					budget.join(q, "127.0.0.1")
				}
				for pb.Next() {
					if q.offer(msg) == "" {
						for _, m := range q.take(1 << 20) {
							q.written(len(m))
						}
					}
				}
			})
		})
	}
}
