package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Issue 29, finding 4: one address slowed live delivery for everyone. Every live event was
// matched against every subscription, and every copy built, on the one goroutine the replication
// tail delivers through: 128 connections from one address holding 32 catch-all subscriptions each
// took a victim's live latency from under 40 ms to 9.6 s. Scaled to a small machine: the victim,
// on another address (127.0.0.2; Linux routes all of 127/8 to lo), publishes and reads its own
// events while 48 connections from 127.0.0.1 hold 32 catch-all subscriptions each and four
// publishers there send 100 events/s. The bar: the p99 of the victim's live delivery (from
// the OK, which follows the commit, to the live event) under the flood stays within 2x of its p99
// alone (plus fairSlack), and under 250 ms.
//
// Short alone and loaded rounds alternate, so that whatever else loads the machine (make test
// runs packages side by side) weighs on both. The p99 compared is each round's (its slowest of
// about 50 probes), the median over the rounds: on a shared 2-core host a stall of the whole
// machine delays 4 or 5 probes in a row by 50-100 ms, alone or loaded, so the p99 of all probes
// together is decided by which rounds one or two stalls hit. The median ignores up to three such
// rounds on either side, and still sees a flood that delays the victim in every loaded round. The
// p99 of all probes is held to the 250 ms bar. With the machine at a load average of 10-17 from
// other work, even publishers alone (no subscriptions) moved the ratio to 1.0-1.7x; so a miss is
// measured once more, and the test fails when both miss. Unbounded (BUZZ_IP_DELIVERY_RATE=0, or
// main's code before the delivery budget) the ratio was 3-15x in every run.
// The end-to-end latency, acceptance included, is logged: group commit with the flood's events
// and the disk weigh on it, not delivery.
//
// fairSlack is what host noise adds at this scale: alone, the victim's p99 is now 0.3-0.5 ms, and
// under a bounded flood 0.45-1.4 ms from run to run (2.1-2.9x in 7 of 12 runs on 2026-12-07, on
// main and on the code of the day before alike). The budget's failure is not that small: with it
// off (BUZZ_IP_DELIVERY_RATE=0) the p99 under the flood was 2.4-2.8 ms against 0.37-0.42 alone.
const fairSlack = 500 * time.Microsecond

func TestFloodingAddressDoesNotDelayOthers(t *testing.T) {
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: testenv.DB(t)})
	f := newFloodScenario(t, r.URL)
	for attempt := 1; ; attempt++ {
		m := f.measure(t)
		if len(m.loaded) < len(m.loadedAll)/2 {
			t.Fatalf("only %d of the %d events published under the flood were acknowledged", len(m.loaded), len(m.loadedAll))
		}
		if all := p99(m.loaded); all >= 250*time.Millisecond {
			t.Fatalf("under the flood the victim's live p99 is %v over all probes: want under 250ms", all)
		}
		q, l := pct(m.quietRounds, 50), pct(m.loadedRounds, 50)
		if l <= 2*q+fairSlack {
			return
		}
		if attempt == 2 {
			t.Fatalf("under the flood the victim's live p99 is %v, alone %v (medians of the rounds), twice: want at most 2x + %v", l, q, fairSlack)
		}
		t.Logf("under the flood the victim's live p99 is %v, alone %v: over 2x; measuring again", l, q)
	}
}

// floodScenario is finding 4's scenario on a relay: the victim, and the flood's publishers.
type floodScenario struct {
	url    string
	victim *fairClient
	v      testenv.User
	pubs   []*fairClient
}

// floodRun is what one measurement saw: the victim's live latencies alone and under the flood,
// each round's p99, and its end-to-end latencies (from its EVENT).
type floodRun struct {
	quiet, loaded, quietAll, loadedAll, quietRounds, loadedRounds []time.Duration
}

const (
	floodConns  = 48
	subsPerConn = 32
	floodRate   = 100 // events per second, from four publishers
	floodRounds = 8
)

func newFloodScenario(t *testing.T, url string) *floodScenario {
	f := &floodScenario{url: url, victim: newFairClient(t, url, "127.0.0.2"), v: testenv.NewUser()}
	f.victim.send(t, "REQ", "v", nostr.Filter{Authors: []string{f.v.PK}, Limit: 0})
	for range 4 {
		pub := newFairClient(t, url, "127.0.0.1")
		pub.discard(nil)
		f.pubs = append(f.pubs, pub)
	}
	return f
}

// measure runs floodRounds rounds: the victim probes alone for a second, then under the flood for
// 1.25 s.
func (f *floodScenario) measure(t *testing.T) (m floodRun) {
	var flooded atomic.Int64 // bytes the flood's subscribers received
	var floodFor time.Duration
	var floodBytes int64
	for round := 0; round < floodRounds; round++ {
		all, live := f.victim.probe(t, f.v, time.Second)
		m.quiet, m.quietAll, m.quietRounds = append(m.quiet, live...), append(m.quietAll, all...), append(m.quietRounds, p99(live))

		// The flood's subscribers come for the loaded round only: the victim's own events would
		// otherwise reach their catch-all subscriptions in the alone rounds too.
		flood := make([]*fairClient, floodConns)
		for i := range flood {
			flood[i] = newFairClient(t, f.url, "127.0.0.1")
			for j := 0; j < subsPerConn; j++ {
				flood[i].send(t, "REQ", fmt.Sprint("x", j), map[string]any{"limit": 0})
			}
			flood[i].discard(&flooded)
		}
		ctx, stop := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for _, pub := range f.pubs {
			wg.Add(1)
			go func() { defer wg.Done(); pub.publishEvery(ctx, time.Second*time.Duration(len(f.pubs))/floodRate) }()
		}
		time.Sleep(500 * time.Millisecond) // the flood reaches its rate
		from, began := flooded.Load(), time.Now()
		all, live = f.victim.probe(t, f.v, 1250*time.Millisecond)
		floodBytes, floodFor = floodBytes+flooded.Load()-from, floodFor+time.Since(began)
		m.loaded, m.loadedAll, m.loadedRounds = append(m.loaded, live...), append(m.loadedAll, all...), append(m.loadedRounds, p99(live))
		stop()
		wg.Wait()
		for _, c := range flood {
			_ = c.ws.Close()
		}
		time.Sleep(300 * time.Millisecond) // the relay lets the flood's connections go
	}
	q, l := pct(m.quietRounds, 50), pct(m.loadedRounds, 50)
	t.Logf("victim, from the OK (commit) to its live event, median of the rounds' p99: %v alone, %v under the flood (%.1fx)",
		q, l, float64(l)/float64(max(q, 1)))
	t.Logf("the rounds' p99: alone %v, under the flood %v", m.quietRounds, m.loadedRounds)
	t.Logf("all probes: p99 %v alone, %v under the flood (p50 %v and %v; %d and %d samples)",
		p99(m.quiet), p99(m.loaded), pct(m.quiet, 50), pct(m.loaded, 50), len(m.quiet), len(m.loaded))
	t.Logf("victim, from its EVENT to its live event: p99 %v alone, %v under the flood", p99(m.quietAll), p99(m.loadedAll))
	t.Logf("the flood's subscribers received %.1f MB/s while the victim probed", float64(floodBytes)/floodFor.Seconds()/1e6)
	return m
}

// fairClient is a bare WebSocket client dialled from a chosen local address.
type fairClient struct {
	ws  *websocket.Conn
	mu  sync.Mutex
	got map[string]time.Time // event id -> when it arrived (probe)
}

func newFairClient(t *testing.T, url, local string) *fairClient {
	t.Helper()
	nd := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	d := websocket.Dialer{NetDialContext: nd.DialContext, HandshakeTimeout: 10 * time.Second}
	ws, _, err := d.Dial(url, nil)
	if err != nil {
		t.Fatalf("dial from %s: %v", local, err)
	}
	t.Cleanup(func() { _ = ws.Close() })
	return &fairClient{ws: ws, got: map[string]time.Time{}}
}

func (c *fairClient) send(t *testing.T, msg ...any) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.ws.WriteJSON(msg); err != nil {
		t.Fatal(err)
	}
}

// discard reads and drops everything, cheaply, so that the test's own reading costs the machine
// as little as possible (the relay's pings go unanswered, which a short test does not notice). It
// adds the bytes read to n, unless n is nil.
func (c *fairClient) discard(n *atomic.Int64) {
	go func() {
		buf := make([]byte, 64<<10)
		for {
			k, err := c.ws.NetConn().Read(buf)
			if n != nil {
				n.Add(int64(k))
			}
			if err != nil {
				return
			}
		}
	}()
}

// publishEvery publishes a new kind 1 every interval until ctx ends.
func (c *fairClient) publishEvery(ctx context.Context, interval time.Duration) {
	u := testenv.NewUser()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for n := 0; ; n++ {
		ev := nostr.Event{Kind: 1, CreatedAt: nostr.Now(), Content: fmt.Sprint("flood ", n), Tags: nostr.Tags{}}
		_ = ev.Sign(u.SK)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		c.mu.Lock()
		err := c.ws.WriteJSON([]any{"EVENT", ev})
		c.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// probe publishes one event of u every 20 ms for d and returns how long each took to come back
// on the client's subscription "v". The first probe starts the reader.
func (c *fairClient) probe(t *testing.T, u testenv.User, d time.Duration) (endToEnd, live []time.Duration) {
	t.Helper()
	c.startReader()
	type sent struct {
		id string
		at time.Time
	}
	var all []sent
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		ev := u.Event(t, 1, nil, fmt.Sprint("probe ", time.Now().UnixNano()))
		at := time.Now()
		c.send(t, "EVENT", ev)
		all = append(all, sent{ev.ID, at})
	}
	for wait := time.Now().Add(time.Second); time.Now().Before(wait) && !c.arrived(all[len(all)-1].id); {
		time.Sleep(10 * time.Millisecond) // the last ones come back (or count as late)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, s := range all {
		got, there := c.got[s.id]
		if !there {
			got = time.Now() // not there yet: at least this late
		}
		endToEnd = append(endToEnd, got.Sub(s.at))
		// Live delivery starts at the commit, which the OK follows: the acceptance path before
		// it (group commit with the flood's events, the disk) is not what this test is about.
		if ok, acked := c.got["ok:"+s.id]; acked {
			live = append(live, max(0, got.Sub(ok)))
		}
	}
	return endToEnd, live
}

// arrived reports whether the event id came back live.
func (c *fairClient) arrived(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, there := c.got[id]
	return there
}

func (c *fairClient) startReader() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.got[""] != (time.Time{}) {
		return
	}
	c.got[""] = time.Now()
	go func() {
		for {
			_, data, err := c.ws.ReadMessage()
			if err != nil {
				return
			}
			if bytes.HasPrefix(data, []byte(`["OK","`)) && len(data) > 70 {
				c.mu.Lock()
				c.got["ok:"+string(data[7:71])] = time.Now()
				c.mu.Unlock()
				continue
			}
			if !bytes.HasPrefix(data, []byte(`["EVENT"`)) {
				continue
			}
			var msg []json.RawMessage
			var ev struct {
				ID string `json:"id"`
			}
			if json.Unmarshal(data, &msg) != nil || len(msg) < 3 || json.Unmarshal(msg[2], &ev) != nil {
				continue
			}
			c.mu.Lock()
			if _, dup := c.got[ev.ID]; !dup {
				c.got[ev.ID] = time.Now()
			}
			c.mu.Unlock()
		}
	}()
}

func p99(ds []time.Duration) time.Duration { return pct(ds, 99) }

// pct is the p-th percentile of ds (nearest rank).
func pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[(len(s)*p+99)/100-1]
}
