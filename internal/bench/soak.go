package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/wsclient"
)

// Soak (make soak-upkeep): for cfg.Duration, steady traffic through the relays: DM messages with
// hides and resurfacing messages, reminders armed on a bounded set of addresses (each replaced
// before or after it fires), and kind 1 events with a short NIP-40 expiration, while the relays'
// upkeep purges (its interval, grace and reminder keep come from the relays' BUZZ_UPKEEP_*
// environment). Every minute it prints the sizes of the hot tables and their indexes and the WAL
// the replication slots retain. At the end it checks the issue 31 bar: no expired event older
// than the grace period (plus one purge interval, the purge's cadence) in buzz.events, the hot
// tables grew by less than 10% from the end of the warm-up (a third of the run, at most 5
// minutes) to the end, and the retained WAL stayed under soakWALBound.
func Soak(cfg *Config) (*Result, error) {
	if cfg.Rate <= 0 {
		cfg.Rate = soakDefaultRate
	}
	pool, err := openPool(cfg, 4)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	s := &soak{cfg: cfg, pool: pool, res: newResult("soak", cfg), tag: runTag()}
	cfg.logf("soak: opening %d DMs", soakPairs)
	if s.pairs, err = openPairs(pool, soakPairs); err != nil {
		return nil, err
	}
	cs, err := dialAll(cfg.Relays, cfg.Conns, nil, nil)
	if err != nil {
		return nil, err
	}
	defer closeAll(cs)
	s.samples = append(s.samples, s.sample(0))
	s.printHeader()
	s.printSample(s.samples[0])
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration)
	defer cancel()
	done := make(chan Row, 1)
	go func() {
		row := s.traffic(ctx, cs)
		cancel() // at the deadline, or early once every connection has closed: an idle database proves nothing
		done <- row
	}()
	s.sampleEveryMinute(ctx)
	row := <-done
	row.Name, row.Conns = "soak traffic (all kinds)", cfg.Conns
	s.res.Rows = append(s.res.Rows, row)
	err = s.check()
	if lost := s.lost.Load(); lost > 0 {
		err = errors.Join(err, fmt.Errorf("soak: %d of %d connections closed before the end (are the relays still up?)", lost, len(cs)))
	}
	if err != nil {
		s.res.Print(os.Stdout) // the load tool prints only the results of scenarios that pass
		return s.res, err
	}
	return s.res, nil
}

const (
	soakDefaultRate = 100 // events per second, all kinds together
	soakPairs       = 64  // DMs; 128 viewers in visibility_state
	soakAddresses   = 200 // reminder addresses reused over and over
	soakWALBound    = 64 << 20
)

type soak struct {
	cfg     *Config
	pool    *pgxpool.Pool
	res     *Result
	tag     string
	pairs   []dmPair
	samples []soakSample
	mu      sync.Mutex
	step    int
	sent    tally        // events published (OK or not)
	lost    atomic.Int64 // connections that closed before the end
}

// next is the event the traffic sends at step k: 70% DM (a cycle of hides, resurfacing and plain
// messages), 20% kind 1 expiring 5 to 60 s later, 10% reminders due 2 to 30 s later.
func (s *soak) next(k int) *nostr.Event {
	now := time.Now().Unix()
	switch r := k % 10; {
	case r < 7:
		p := s.pairs[rand.IntN(len(s.pairs))]
		h := nostr.Tags{{"h", p.Ch}}
		switch rand.IntN(10) {
		case 0:
			return p.B.Sign(41012, h, "")
		case 1:
			return p.A.Sign(41012, h, "")
		case 2, 3, 4, 5:
			return p.A.Sign(9, h, "soak "+strconv.Itoa(k))
		default:
			return p.B.Sign(9, h, "soak "+strconv.Itoa(k))
		}
	case r < 9:
		p := s.pairs[rand.IntN(len(s.pairs))]
		exp := now + 5 + rand.Int64N(55)
		return p.A.Sign(1, nostr.Tags{{"expiration", strconv.FormatInt(exp, 10)}, {"t", "soak-" + s.tag}}, "")
	default:
		a := rand.IntN(soakAddresses)
		p := s.pairs[a%len(s.pairs)]
		nb := now + 2 + rand.Int64N(28)
		return p.A.Sign(30300, nostr.Tags{{"d", fmt.Sprintf("soak-%s-%d", s.tag, a)}, {"not_before", strconv.FormatInt(nb, 10)}}, "remind")
	}
}

// traffic publishes s.next events at cfg.Rate over the connections until ctx ends. The traffic
// stays steady: each connection publishes on a ticker, which drops the ticks a stalled publisher
// misses, so a host that stalls the load generator gets a lower rate for a while, never a burst
// above cfg.Rate. (runWorkers catches up instead: on a 2-core host running other work, minutes of
// 3,000 events followed a minute of 8,000, which doubled the live reminder set; tables then keep
// the space that peak needed.)
func (s *soak) traffic(ctx context.Context, cs []*wsclient.Client) Row {
	start := time.Now()
	every := time.Duration(float64(len(cs)) / s.cfg.Rate * float64(time.Second))
	var wg sync.WaitGroup
	for w := range cs {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			t := time.NewTicker(every)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				s.mu.Lock()
				s.step++
				ev := s.next(s.step)
				s.mu.Unlock()
				lat, msg, more := publishJob(cs[w:w+1], [][]*nostr.Event{{ev}})(0, 0)
				if !more {
					s.sent.errs.Add(msg)
					s.lost.Add(1)
					return
				}
				s.sent.add(lat, msg)
			}
		}(w)
	}
	wg.Wait()
	return s.sent.row(start, s.cfg.Rate)
}

// sampleEveryMinute takes a sample at every whole minute of the run, and one at its end.
func (s *soak) sampleEveryMinute(ctx context.Context) {
	start := time.Now()
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			sm := s.sample(time.Since(start))
			s.samples = append(s.samples, sm)
			s.printSample(sm)
			return
		case <-t.C:
			sm := s.sample(time.Since(start))
			s.samples = append(s.samples, sm)
			s.printSample(sm)
		}
	}
}

// upkeepInterval is the relays' purge interval, from the environment they inherit.
func upkeepInterval() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("BUZZ_UPKEEP_INTERVAL")); err == nil && d > 0 {
		return d
	}
	return time.Minute
}
