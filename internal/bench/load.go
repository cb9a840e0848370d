package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/wsclient"
)

// Config is what every scenario gets from the command line.
type Config struct {
	Relays      []string
	DatabaseURL string
	RelayKey    string // hex secret key of the relays (converge baseline signs snapshots with it)
	Duration    time.Duration
	Conns       int
	Rate        float64 // target total rate; 0 = as fast as closed loops go
	N           int     // events (or reminders) to pre-sign; an upper bound on one run
	Idle        int     // fanout: quiet connections held open beside the scenario's (dialIdle)
	NoBaseline  bool    // ingest: the relay run only
	Logf        func(format string, args ...any)
	// Spawn, when set (bench --spawn), starts one more `buzzpg serve` on loopback with extra
	// environment (KEY=VALUE) and returns its WebSocket URL and how to stop it (flood uses it
	// for relays with and without rate limits).
	Spawn func(name string, env []string) (url string, stop func(), err error)
}

func (c *Config) logf(format string, args ...any) {
	if c.Logf != nil {
		c.Logf(format, args...)
	}
}

// User is a bench identity.
type User struct{ SK, PK string }

// NewUser makes a fresh identity.
func NewUser() User {
	sk := nostr.GeneratePrivateKey()
	pk, _ := nostr.GetPublicKey(sk)
	return User{sk, pk}
}

var nonce atomic.Int64

// Sign builds and signs an event by u; content gets a nonce when empty so ids stay distinct.
func (u User) Sign(kind int, tags nostr.Tags, content string) *nostr.Event {
	if content == "" {
		content = fmt.Sprintf("n%d-%d", time.Now().UnixNano(), nonce.Add(1))
	}
	if tags == nil {
		tags = nostr.Tags{}
	}
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: tags, Content: content}
	if err := ev.Sign(u.SK); err != nil {
		panic(err)
	}
	return ev
}

// signParallel fills out[i] = mk(i) on all cores.
func signParallel(n int, mk func(i int) *nostr.Event) []*nostr.Event {
	out := make([]*nostr.Event, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < runtime.GOMAXPROCS(0); g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				out[i] = mk(i)
			}
		}()
	}
	wg.Wait()
	return out
}

// job runs the k-th unit of work of worker w and returns its latency and, on failure, a message
// whose prefix (before ':') is the error class. ok=false with msg "" means the worker is done.
type job func(w, k int) (lat time.Duration, msg string, more bool)

// runWorkers runs perWorker[w] jobs on each worker, closed loop; with rate > 0 the workers are
// paced so the total stays at rate. It stops at dur. Returns the row (without name/conns).
func runWorkers(perWorker []int, rate float64, dur time.Duration, do job) Row {
	var t tally
	start := time.Now()
	deadline := start.Add(dur)
	var wg sync.WaitGroup
	per := rate / float64(len(perWorker))
	for w := range perWorker {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for k := 0; k < perWorker[w]; k++ {
				now := time.Now()
				if now.After(deadline) {
					return
				}
				if per > 0 {
					due := start.Add(time.Duration(float64(k) / per * float64(time.Second)))
					if due.After(deadline) {
						return
					}
					if d := due.Sub(now); d > 0 {
						time.Sleep(d)
					}
				}
				lat, msg, more := do(w, k)
				if !more {
					return
				}
				t.add(lat, msg)
			}
		}(w)
	}
	wg.Wait()
	return t.row(start, rate)
}

// dialAll opens n connections round-robin over the relays, authenticating connection i as
// auth(i) when auth is non-nil.
func dialAll(relays []string, n int, auth func(i int) string, h func(i int) wsclient.Handlers) ([]*wsclient.Client, error) {
	return dialEach(n, n, func(i int) (*wsclient.Client, error) {
		var hh wsclient.Handlers
		if h != nil {
			hh = h(i)
		}
		c, err := wsclient.Dial(relays[i%len(relays)], hh, 10*time.Second)
		if err == nil && auth != nil {
			if sk := auth(i); sk != "" {
				err = c.Auth(sk, 10*time.Second, nil)
			}
		}
		if err != nil {
			err = fmt.Errorf("connect %s: %w", relays[i%len(relays)], err)
		}
		return c, err
	})
}

// dialEach sets up connections 0..n-1 with dial, at most parallel at once; on any error it closes
// every one and returns the first error.
func dialEach(n, parallel int, dial func(i int) (*wsclient.Client, error)) ([]*wsclient.Client, error) {
	cs := make([]*wsclient.Client, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	sem := make(chan struct{}, max(1, parallel))
	for i := 0; i < n; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := dial(i)
			mu.Lock()
			defer mu.Unlock()
			cs[i] = c
			if err != nil && first == nil {
				first = err
			}
		}(i)
	}
	wg.Wait()
	if first != nil {
		closeAll(cs)
		return nil, first
	}
	return cs, nil
}

func closeAll(cs []*wsclient.Client) {
	for _, c := range cs {
		if c != nil {
			c.Close()
		}
	}
}

// publishJob publishes evs[w][k] on cs[w] and waits for the OK.
func publishJob(cs []*wsclient.Client, evs [][]*nostr.Event) job {
	return func(w, k int) (time.Duration, string, bool) {
		ev := evs[w][k]
		t0 := time.Now()
		o, err := cs[w].Publish(ev, 30*time.Second)
		switch {
		case err == wsclient.ErrTimeout:
			return time.Since(t0), "timeout", true
		case err != nil:
			return time.Since(t0), "closed", false
		case !o.OK:
			return o.At.Sub(t0), o.Msg, true
		case strings.HasPrefix(o.Msg, "duplicate:"):
			return o.At.Sub(t0), o.Msg, true
		}
		return o.At.Sub(t0), "", true
	}
}

// sqlJob runs buzz.accept_event for evs[w][k] through the pool (the same Go call the relay makes).
func sqlJob(pool *pgxpool.Pool, raws [][][]byte) job {
	return func(w, k int) (time.Duration, string, bool) {
		t0 := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		ok, msg, err := store.AcceptJSON(ctx, pool, raws[w][k])
		cancel()
		lat := time.Since(t0)
		switch {
		case err != nil:
			return lat, "error: " + err.Error(), true
		case !ok:
			return lat, msg, true
		case strings.HasPrefix(msg, "duplicate:"):
			return lat, msg, true
		}
		return lat, "", true
	}
}

func marshalAll(evs [][]*nostr.Event) [][][]byte {
	out := make([][][]byte, len(evs))
	for w := range evs {
		out[w] = make([][]byte, len(evs[w]))
		for k, ev := range evs[w] {
			out[w][k], _ = json.Marshal(ev)
		}
	}
	return out
}

func counts(evs [][]*nostr.Event) []int {
	out := make([]int, len(evs))
	for i := range evs {
		out[i] = len(evs[i])
	}
	return out
}

// split deals a flat list round-robin to w workers.
func split(flat []*nostr.Event, w int) [][]*nostr.Event {
	out := make([][]*nostr.Event, w)
	for i, ev := range flat {
		out[i%w] = append(out[i%w], ev)
	}
	return out
}

// openPool opens the baseline/setup pool.
func openPool(cfg *Config, conns int) (*pgxpool.Pool, error) {
	if cfg.DatabaseURL == "" {
		return nil, fmt.Errorf("--database-url (or DATABASE_URL) is needed for the baseline and setup")
	}
	return db.NewPool(context.Background(), cfg.DatabaseURL, "buzzpg-bench", int32(conns))
}

// openDM opens a DM between a and b through accept_event (setup, not timed) and returns its id.
func openDM(pool *pgxpool.Pool, a, b User) (string, error) {
	ev := a.Sign(41010, nostr.Tags{{"p", b.PK}}, "")
	raw, _ := json.Marshal(ev)
	ok, msg, err := store.AcceptJSON(context.Background(), pool, raw)
	if err != nil {
		return "", err
	}
	if !ok || !strings.HasPrefix(msg, "response:") {
		return "", fmt.Errorf("open DM: %v %s", ok, msg)
	}
	var r struct {
		ChannelID string `json:"channel_id"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &r); err != nil {
		return "", err
	}
	return r.ChannelID, nil
}

type dmPair struct {
	A, B User
	Ch   string
}

func openPairs(pool *pgxpool.Pool, n int) ([]dmPair, error) {
	out := make([]dmPair, n)
	for i := range out {
		a, b := NewUser(), NewUser()
		ch, err := openDM(pool, a, b)
		if err != nil {
			return nil, err
		}
		out[i] = dmPair{a, b, ch}
	}
	return out, nil
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
