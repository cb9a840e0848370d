package visibility

import "context"

// counters is a copy of a publisher's counters, for assertions.
type counters struct {
	Published, Stale, Retry, Failed int64
	Sweeps, Repaired                int64 // sweeps run; outbox rows they re-created
	ListenConnects                  int64 // LISTEN (re)connections
}

func (p *Publisher) counters() counters {
	return counters{
		Published: p.stats.published.Load(), Stale: p.stats.stale.Load(),
		Retry: p.stats.retry.Load(), Failed: p.stats.failed.Load(),
		Sweeps: p.stats.sweeps.Load(), Repaired: p.stats.repaired.Load(),
		ListenConnects: p.stats.listenConnects.Load(),
	}
}

// listening reports whether the LISTEN connection is up.
func (p *Publisher) listening() bool { return p.listenUp.Load() }

// publisherInstance returns the InstanceID of the publisher whose hook point runs under ctx (""
// elsewhere).
func publisherInstance(ctx context.Context) string {
	s, _ := ctx.Value(publisherKey{}).(string)
	return s
}
