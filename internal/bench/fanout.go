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

func fanoutStep(cfg *Config, a, b string, rate float64, dur time.Duration) (Row, bool, error) {
	n := int(rate * dur.Seconds())
	pubs := cfg.Conns
	tag := "fan-" + runTag()
	users := make([]User, pubs)
	for i := range users {
		users[i] = NewUser()
	}
	cfg.logf("fanout: %0.f/s for %s: pre-signing %d", rate, dur, n)
	flat := signParallel(n, func(i int) *nostr.Event {
		return users[i%pubs].Sign(1, nostr.Tags{{"t", tag}}, fmt.Sprintf("%s %d", tag, i))
	})
	idx := make(map[string]int, n)
	for i, ev := range flat {
		idx[ev.ID] = i
	}
	sent := make([]atomic.Int64, n) // unix nanos of the write on A
	var lats Latencies
	var mu sync.Mutex
	got := map[string]bool{}
	var okErrs Errors
	var oks atomic.Int64
	sub, err := wsclient.Dial(b, wsclient.Handlers{OnEvent: func(s string, ev *nostr.Event, at time.Time) {
		i, ok := idx[ev.ID]
		if !ok {
			return
		}
		mu.Lock()
		dup := got[ev.ID]
		got[ev.ID] = true
		mu.Unlock()
		if dup {
			okErrs.Add("duplicate-delivery")
			return
		}
		if t := sent[i].Load(); t > 0 {
			lats.Add(at.Sub(time.Unix(0, t)))
		}
	}}, 10*time.Second)
	if err != nil {
		return Row{}, false, err
	}
	defer sub.Close()
	if err := sub.Req("fan", 10*time.Second, nostr.Filter{Kinds: []int{1}, Tags: nostr.TagMap{"t": {tag}}}); err != nil {
		return Row{}, false, err
	}
	cs, err := dialAll([]string{a}, pubs, nil, func(int) wsclient.Handlers {
		return wsclient.Handlers{OnOK: func(o wsclient.OK) {
			if _, ok := idx[o.ID]; !ok {
				return
			}
			oks.Add(1)
			if !o.OK {
				okErrs.Add(o.Msg)
			}
		}}
	})
	if err != nil {
		return Row{}, false, err
	}
	defer closeAll(cs)
	per := split(flat, pubs)
	perIdx := make([][]int, pubs)
	for i := range flat {
		perIdx[i%pubs] = append(perIdx[i%pubs], i)
	}
	perRate := rate / float64(pubs)
	cfg.logf("fanout: sending %d on %d connections", n, pubs)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < pubs; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for k, ev := range per[w] {
				due := start.Add(time.Duration(float64(k) / perRate * float64(time.Second)))
				if d := time.Until(due); d > 0 {
					time.Sleep(d)
				}
				sent[perIdx[w][k]].Store(time.Now().UnixNano())
				if err := cs[w].Send(ev); err != nil {
					okErrs.Add("closed")
					return
				}
			}
		}(w)
	}
	wg.Wait()
	sendEl := time.Since(start)
	wait := time.Now().Add(5 * time.Second)
	for time.Now().Before(wait) {
		mu.Lock()
		g := len(got)
		mu.Unlock()
		if g >= n && oks.Load() >= int64(n) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	mu.Lock()
	delivered := len(got)
	mu.Unlock()
	s := lats.Summary()
	errs := okErrs.Map()
	if delivered < n {
		errs["undelivered"] = n - delivered
	}
	achieved := float64(n) / sendEl.Seconds()
	kept := delivered == n && s.P99ms < 1000 && achieved >= 0.9*rate && len(okErrs.Map()) == 0
	row := Row{Name: fmt.Sprintf("A->B at %.0f/s", rate), Conns: pubs, Count: delivered, Seconds: sendEl.Seconds(),
		Rate: achieved, Target: rate, Latency: s, Errors: errs,
		Note: fmt.Sprintf("kept up: %v (sent %d, delivered %d, OKs %d)", kept, n, delivered, oks.Load())}
	return row, kept, nil
}
