package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
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
// events; the p99 of its live delivery (from the OK, which follows the commit, to the live event)
// with the flood running must stay under 250 ms.
// Before per-connection inboxes (relay/inbox.go), on a 2-core machine: 13 ms alone, 1.3 s under
// the flood. The end-to-end latency, acceptance included, is logged: group commit with the
// flood's events and the disk weigh on it, not delivery.
func TestFloodingAddressDoesNotDelayOthers(t *testing.T) {
	const (
		floodConns  = 48
		subsPerConn = 32
		floodRate   = 100 // events per second, from four publishers
		quietFor    = 4 * time.Second
		loadedFor   = 10 * time.Second
	)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: testenv.DB(t)})
	victim := newFairClient(t, r.URL, "127.0.0.2")
	v := testenv.NewUser()
	victim.send(t, "REQ", "v", nostr.Filter{Authors: []string{v.PK}, Limit: 0})

	quietAll, quiet := victim.probe(t, v, quietFor)
	for i := 0; i < floodConns; i++ {
		c := newFairClient(t, r.URL, "127.0.0.1")
		for j := 0; j < subsPerConn; j++ {
			c.send(t, "REQ", fmt.Sprint("x", j), map[string]any{"limit": 0})
		}
		c.discard()
	}
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for p := 0; p < 4; p++ {
		pub := newFairClient(t, r.URL, "127.0.0.1")
		pub.discard()
		wg.Add(1)
		go func() { defer wg.Done(); pub.publishEvery(ctx, time.Second*4/floodRate) }()
	}
	time.Sleep(time.Second) // the flood reaches its rate
	loadedAll, loaded := victim.probe(t, v, loadedFor)
	stop()
	wg.Wait()

	q, l := p99(quiet), p99(loaded)
	t.Logf("victim, from the OK (commit) to its live event: p99 %v alone, %v under the flood (p50 %v and %v; %d and %d samples)",
		q, l, pct(quiet, 50), pct(loaded, 50), len(quiet), len(loaded))
	t.Logf("victim, from its EVENT to its live event: p99 %v alone, %v under the flood", p99(quietAll), p99(loadedAll))
	if len(loaded) < len(loadedAll)/2 {
		t.Fatalf("only %d of the %d events published under the flood were acknowledged", len(loaded), len(loadedAll))
	}
	// Only the absolute bound is asserted: this test shares 2 cores with other packages' tests,
	// which move a p99 of a few milliseconds by a hundred. The ratio is logged; on a quiet machine
	// it was 3.9 ms alone and 53 ms under the flood. Before the inboxes the flood took it past 1 s.
	if l >= 250*time.Millisecond {
		t.Errorf("under the flood the victim's live p99 is %v (alone %v): want under 250ms", l, q)
	}
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
// as little as possible (the relay's pings go unanswered, which a short test does not notice).
func (c *fairClient) discard() {
	go func() { _, _ = io.Copy(io.Discard, c.ws.NetConn()) }()
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

// probe publishes one event of u every 50 ms for d and returns how long each took to come back
// on the client's subscription "v". The first probe starts the reader.
func (c *fairClient) probe(t *testing.T, u testenv.User, d time.Duration) (endToEnd, live []time.Duration) {
	t.Helper()
	c.startReader()
	type sent struct {
		id string
		at time.Time
	}
	var all []sent
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		ev := u.Event(t, 1, nil, fmt.Sprint("probe ", time.Now().UnixNano()))
		at := time.Now()
		c.send(t, "EVENT", ev)
		all = append(all, sent{ev.ID, at})
	}
	time.Sleep(time.Second) // the last ones come back (or count as late)
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
