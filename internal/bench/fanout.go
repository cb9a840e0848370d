package bench

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/buzzpg/buzzpg/internal/wsclient"
	"github.com/nbd-wtf/go-nostr"
)

// Fanout: publishers on the first relay (process A) send kind 1 at a paced total rate (pipelined:
// they do not wait for OKs); one subscriber on the last relay (process B) receives them. Latency =
// receive time on B - write time on A. With --rate one step at that rate; otherwise a ramp of
// doubling rates, stopping at the first step that does not keep up (not everything delivered
// within 5 s after the last send, p99 above 1 s, or the publishers fell 10% behind the rate).
// Baseline: buzz.accept_event of the same events closed loop on --conns pool connections (the most
// the database accepts), and the ratio of the highest rate that kept up to it.
func Fanout(cfg *Config) (*Result, error) {
	res := newResult("fanout", cfg)
	a, b := cfg.Relays[0], cfg.Relays[len(cfg.Relays)-1]
	if a == b {
		res.Notes = append(res.Notes, "only one relay: publisher and subscriber on the same process")
	}
	step := cfg.Duration
	rates := []float64{cfg.Rate}
	if cfg.Rate <= 0 {
		if step > 5*time.Second {
			step = 5 * time.Second
		}
		rates = []float64{250, 350, 500, 700, 1000, 1400, 2000, 2800, 4000, 5600, 8000, 11000, 16000}
	}
	idle, err := dialIdle(cfg.Relays, cfg.Idle, cfg.logf)
	if err != nil {
		return nil, err
	}
	defer closeAll(idle)
	if cfg.Idle > 0 {
		res.Notes = append(res.Notes, fmt.Sprintf("%d idle connections spread over the relays, each authenticated and subscribed to its snapshots and a 50-author feed", cfg.Idle))
		res.Extra["idle_connections"] = float64(cfg.Idle)
	}
	best := 0.0
	for _, rate := range rates {
		row, keptUp, err := fanoutStep(cfg, a, b, rate, step)
		if err != nil {
			return nil, err
		}
		res.Rows = append(res.Rows, row)
		if !keptUp {
			break
		}
		best = rate
	}
	res.Extra["max_rate_kept_up"] = best

	// Baseline.
	pool, err := openPool(cfg, cfg.Conns)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	u := NewUser()
	n := cfg.N
	flat := signParallel(n, func(i int) *nostr.Event {
		return u.Sign(1, nostr.Tags{{"t", "fanout-sql"}}, fmt.Sprintf("fanout sql %d %d", time.Now().UnixNano(), i))
	})
	evs := split(flat, cfg.Conns)
	dur := cfg.Duration
	if dur > 10*time.Second {
		dur = 10 * time.Second
	}
	cfg.logf("fanout: SQL baseline")
	base := runWorkers(counts(evs), 0, dur, sqlJob(pool, marshalAll(evs)))
	base.Name, base.Conns, base.Baseline = "buzz.accept_event kind 1 (max)", cfg.Conns, true
	res.Rows = append(res.Rows, base)
	res.Ratio = ratio(best, base.Rate)
	res.RatioWhat = fmt.Sprintf("highest rate delivered A->B in time (%.0f/s) / accept_event rate on %d connections", best, cfg.Conns)
	return res, nil
}

// fanoutStep sends at rate for dur on relay a and reports what relay b delivered, and whether it
// kept up.
func fanoutStep(cfg *Config, a, b string, rate float64, dur time.Duration) (Row, bool, error) {
	s := newFanStep(cfg, rate, dur)
	sub, err := s.subscribe(b)
	if err != nil {
		return Row{}, false, err
	}
	defer sub.Close()
	cs, err := dialAll([]string{a}, s.pubs, nil, s.publisherHandlers)
	if err != nil {
		return Row{}, false, err
	}
	defer closeAll(cs)
	sendEl := s.send(cs)
	s.waitDelivered(5 * time.Second)
	row, kept := s.row(sendEl)
	return row, kept, nil
}

// fanStep is one rate of the fan-out ramp: n pre-signed events sent on A at rate, received on B.
type fanStep struct {
	cfg    *Config
	rate   float64
	n      int
	pubs   int
	tag    string
	flat   []*nostr.Event
	idx    map[string]int // event id -> index in flat
	sent   []atomic.Int64 // unix nanos of the write on A
	lats   Latencies
	mu     sync.Mutex
	got    map[string]bool
	okErrs Errors
	oks    atomic.Int64
}

// newFanStep pre-signs the step's events, one publisher identity per connection.
func newFanStep(cfg *Config, rate float64, dur time.Duration) *fanStep {
	s := &fanStep{cfg: cfg, rate: rate, n: int(rate * dur.Seconds()), pubs: cfg.Conns, tag: "fan-" + runTag(), got: map[string]bool{}}
	users := make([]User, s.pubs)
	for i := range users {
		users[i] = NewUser()
	}
	cfg.logf("fanout: %0.f/s for %s: pre-signing %d", rate, dur, s.n)
	s.flat = signParallel(s.n, func(i int) *nostr.Event {
		return users[i%s.pubs].Sign(1, nostr.Tags{{"t", s.tag}}, fmt.Sprintf("%s %d", s.tag, i))
	})
	s.idx = make(map[string]int, s.n)
	for i, ev := range s.flat {
		s.idx[ev.ID] = i
	}
	s.sent = make([]atomic.Int64, s.n)
	return s
}

// subscribe connects the receiver on b to the step's tag; it times each first arrival.
func (s *fanStep) subscribe(b string) (*wsclient.Client, error) {
	sub, err := wsclient.Dial(b, wsclient.Handlers{OnEvent: func(_ string, ev *nostr.Event, at time.Time) {
		i, ok := s.idx[ev.ID]
		if !ok {
			return
		}
		s.mu.Lock()
		dup := s.got[ev.ID]
		s.got[ev.ID] = true
		s.mu.Unlock()
		if dup {
			s.okErrs.Add("duplicate-delivery")
			return
		}
		if t := s.sent[i].Load(); t > 0 {
			s.lats.Add(at.Sub(time.Unix(0, t)))
		}
	}}, 10*time.Second)
	if err != nil {
		return nil, err
	}
	if err := sub.Req("fan", 10*time.Second, nostr.Filter{Kinds: []int{1}, Tags: nostr.TagMap{"t": {s.tag}}}); err != nil {
		sub.Close()
		return nil, err
	}
	return sub, nil
}

// publisherHandlers count the OKs of the step's events.
func (s *fanStep) publisherHandlers(int) wsclient.Handlers {
	return wsclient.Handlers{OnOK: func(o wsclient.OK) {
		if _, ok := s.idx[o.ID]; !ok {
			return
		}
		s.oks.Add(1)
		if !o.OK {
			s.okErrs.Add(o.Msg)
		}
	}}
}

// send paces the events over the connections (event i on connection i%pubs) and returns how
// long sending took.
func (s *fanStep) send(cs []*wsclient.Client) time.Duration {
	per := split(s.flat, s.pubs)
	perIdx := make([][]int, s.pubs)
	for i := range s.flat {
		perIdx[i%s.pubs] = append(perIdx[i%s.pubs], i)
	}
	perRate := s.rate / float64(s.pubs)
	s.cfg.logf("fanout: sending %d on %d connections", s.n, s.pubs)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < s.pubs; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for k, ev := range per[w] {
				due := start.Add(time.Duration(float64(k) / perRate * float64(time.Second)))
				if d := time.Until(due); d > 0 {
					time.Sleep(d)
				}
				s.sent[perIdx[w][k]].Store(time.Now().UnixNano())
				if err := cs[w].Send(ev); err != nil {
					s.okErrs.Add("closed")
					return
				}
			}
		}(w)
	}
	wg.Wait()
	return time.Since(start)
}

// delivered is how many of the step's events B received.
func (s *fanStep) delivered() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.got)
}

// waitDelivered waits up to d for every event's delivery and OK.
func (s *fanStep) waitDelivered(d time.Duration) {
	wait := time.Now().Add(d)
	for time.Now().Before(wait) {
		if s.delivered() >= s.n && s.oks.Load() >= int64(s.n) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// row reports the step and whether the relays kept up with its rate.
func (s *fanStep) row(sendEl time.Duration) (Row, bool) {
	delivered := s.delivered()
	lat := s.lats.Summary()
	errs := s.okErrs.Map()
	if delivered < s.n {
		errs["undelivered"] = s.n - delivered
	}
	achieved := float64(s.n) / sendEl.Seconds()
	kept := delivered == s.n && lat.P99ms < 1000 && achieved >= 0.9*s.rate && len(s.okErrs.Map()) == 0
	return Row{Name: fmt.Sprintf("A->B at %.0f/s", s.rate), Conns: s.pubs, Count: delivered, Seconds: sendEl.Seconds(),
		Rate: achieved, Target: s.rate, Latency: lat, Errors: errs,
		Note: fmt.Sprintf("kept up: %v (sent %d, delivered %d, OKs %d)", kept, s.n, delivered, s.oks.Load())}, kept
}
