package chaos

import (
	"fmt"
	"sync"
	"time"

	"github.com/buzzpg/buzzpg/internal/bench"
)

// readyBound: a relay is ready again at most this long after the last fault touching it ended.
const readyBound = 20 * time.Second

// Memory bound: RSS at the end at most memFactor × RSS after warm-up + memSlackMB.
const (
	memFactor  = 2.0
	memSlackMB = 50.0
)

// unready is one /readyz probe of a relay that did not answer 200.
type unready struct {
	relay      int
	sent, done time.Time
	why        string
}

// readiness probes every relay's /readyz every 250 ms until stop.
type readiness struct {
	mu      sync.Mutex
	probes  int
	samples []unready
	stop    chan struct{}
	wg      sync.WaitGroup
}

func watchReadiness(fl *fleet) *readiness {
	r := &readiness{stop: make(chan struct{})}
	for i := range fl.ports {
		r.wg.Add(1)
		go func(i int) {
			defer r.wg.Done()
			for {
				select {
				case <-r.stop:
					return
				case <-time.After(250 * time.Millisecond):
				}
				p := fl.proc(i)
				if p == nil {
					continue // down: a kill's window, or an exit the supervisor reports
				}
				sent := time.Now()
				err := bench.Ready(p.HTTPURL)
				r.mu.Lock()
				r.probes++
				if err != nil && fl.proc(i) == p {
					r.samples = append(r.samples, unready{i, sent, time.Now(), err.Error()})
				}
				r.mu.Unlock()
			}
		}(i)
	}
	return r
}

func (r *readiness) halt() {
	close(r.stop)
	r.wg.Wait()
}

// check returns the probes that found a relay unready longer than readyBound after every fault
// touching it had ended (or with no fault at all).
func (r *readiness) check(in *injector) (bad []string, probes, unreadyN int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, s := range r.samples {
		covered := false
		for _, w := range in.windows {
			if w.relay != -1 && w.relay != s.relay {
				continue
			}
			if !w.start.After(s.done) && (w.end.IsZero() || !s.sent.After(w.end.Add(readyBound))) {
				covered = true
				break
			}
		}
		if !covered {
			bad = append(bad, fmt.Sprintf("relay %d unready at %s (probe answered %s: %s), more than %s after any fault touching it",
				s.relay, fmtTime(s.sent), fmtTime(s.done), s.why, readyBound))
		}
	}
	return bad, r.probes, len(r.samples)
}

// memory is each relay's RSS after warm-up and at the end.
type memory struct {
	mu        sync.Mutex
	warm, end []float64
}

// sampleWarm records each relay's RSS once it has run warm after start (retrying a relay that is
// down at that moment).
func sampleWarm(fl *fleet, at time.Time, stop <-chan struct{}) *memory {
	m := &memory{warm: make([]float64, len(fl.ports)), end: make([]float64, len(fl.ports))}
	go func() {
		time.Sleep(time.Until(at))
		for left := len(fl.ports); left > 0; {
			for i := range fl.ports {
				m.mu.Lock()
				if m.warm[i] == 0 {
					if v := fl.rssMB(i); v > 0 {
						m.warm[i] = v
						left--
					}
				}
				m.mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-time.After(time.Second):
			}
		}
	}()
	return m
}

func (m *memory) sampleEnd(fl *fleet) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range fl.ports {
		m.end[i] = fl.rssMB(i)
	}
}

func (m *memory) check() (bad []string, summary string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := range m.warm {
		summary += fmt.Sprintf("relay %d %.0f MB -> %.0f MB; ", i, m.warm[i], m.end[i])
		if m.warm[i] == 0 {
			bad = append(bad, fmt.Sprintf("relay %d: no RSS after warm-up", i))
		} else if m.end[i] > memFactor*m.warm[i]+memSlackMB {
			bad = append(bad, fmt.Sprintf("relay %d: RSS %.0f MB at the end, %.0f MB after warm-up (bound %.1f× + %.0f MB)",
				i, m.end[i], m.warm[i], memFactor, memSlackMB))
		}
	}
	return bad, summary
}

// watchPauses records a fault touching every relay when the host stood still: the wall clock
// jumped ahead of the monotonic one (a paused VM). PostgreSQL's timeouts run on the wall clock,
// so its walsenders then end every replication connection (wal_sender_timeout), as a fault would.
func watchPauses(in *injector, stop <-chan struct{}) {
	prev := time.Now()
	for {
		select {
		case <-stop:
			return
		case <-time.After(100 * time.Millisecond):
		}
		now := time.Now()
		if jump := now.Round(0).Sub(prev.Round(0)) - now.Sub(prev); jump > 2*time.Second {
			w := in.open(-1, fHostPause)
			in.close(w)
			in.mu.Lock()
			w.start = prev
			in.mu.Unlock()
			in.note(fmt.Sprintf("host paused: the wall clock jumped %s ahead of the monotonic one (not injected)", jump.Round(time.Millisecond)))
		}
		prev = now
	}
}
