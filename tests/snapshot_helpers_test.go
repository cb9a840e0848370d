package tests

// Helpers of the NIP-DV (kind 30622) black-box tests: a small NIP-01/42 client and SQL probes.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

type snapClient struct {
	t    testing.TB
	url  string
	conn *websocket.Conn
	wmu  sync.Mutex

	mu        sync.Mutex
	cond      *sync.Cond
	challenge string
	oks       map[string][2]string // id -> {"true"/"false", message}
	events    map[string][]*nostr.Event
	eose      map[string]bool
	closedErr error
	// Optional, called on the reader goroutine with c.mu held (benchmarks time arrivals).
	onEvent func(sub string, ev *nostr.Event, at time.Time)
	onOK    func(id string, at time.Time)
}

func snapDial(t testing.TB, url string) *snapClient {
	t.Helper()
	conn, _, err := (&websocket.Dialer{HandshakeTimeout: 10 * time.Second}).Dial(url, nil)
	if err != nil {
		t.Fatalf("dial %s: %v", url, err)
	}
	c := &snapClient{t: t, url: url, conn: conn, oks: map[string][2]string{},
		events: map[string][]*nostr.Event{}, eose: map[string]bool{}}
	c.cond = sync.NewCond(&c.mu)
	go c.read()
	t.Cleanup(func() { conn.Close() })
	return c
}

func (c *snapClient) read() {
	for {
		_, data, err := c.conn.ReadMessage()
		at := time.Now()
		c.mu.Lock()
		if err != nil {
			c.closedErr = err
			c.cond.Broadcast()
			c.mu.Unlock()
			return
		}
		var msg []json.RawMessage
		if json.Unmarshal(data, &msg) == nil && len(msg) >= 2 {
			var typ, s1 string
			_ = json.Unmarshal(msg[0], &typ)
			_ = json.Unmarshal(msg[1], &s1)
			switch typ {
			case "AUTH":
				c.challenge = s1
			case "OK":
				if len(msg) >= 4 {
					var ok bool
					var m string
					_ = json.Unmarshal(msg[2], &ok)
					_ = json.Unmarshal(msg[3], &m)
					c.oks[s1] = [2]string{fmt.Sprint(ok), m}
					if c.onOK != nil {
						c.onOK(s1, at)
					}
				}
			case "EVENT":
				ev := &nostr.Event{}
				if len(msg) >= 3 && ev.UnmarshalJSON(msg[2]) == nil {
					c.events[s1] = append(c.events[s1], ev)
					if c.onEvent != nil {
						c.onEvent(s1, ev, at)
					}
				}
			case "EOSE":
				c.eose[s1] = true
			case "CLOSED":
				c.eose[s1] = true
				c.events[s1+":closed"] = nil
			}
		}
		c.cond.Broadcast()
		c.mu.Unlock()
	}
}

func (c *snapClient) send(v ...any) {
	c.t.Helper()
	b, _ := json.Marshal(v)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := c.conn.WriteMessage(websocket.TextMessage, b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// waitFor waits (c.mu held while cond runs); the deadline only turns a hang into a failure.
func (c *snapClient) waitFor(what string, timeout time.Duration, cond func() bool) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { c.mu.Lock(); c.cond.Broadcast(); c.mu.Unlock() })
	defer timer.Stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for !cond() {
		if c.closedErr != nil {
			c.t.Fatalf("%s: connection closed: %v", what, c.closedErr)
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("%s: timed out after %s", what, timeout)
		}
		c.cond.Wait()
	}
}

func (c *snapClient) auth(sk string) {
	c.t.Helper()
	var ch string
	c.waitFor("AUTH challenge", 10*time.Second, func() bool { ch = c.challenge; return ch != "" })
	ev := &nostr.Event{Kind: 22242, CreatedAt: nostr.Now(), Tags: nostr.Tags{{"relay", c.url}, {"challenge", ch}}}
	_ = ev.Sign(sk)
	c.send("AUTH", ev)
	c.waitFor("AUTH OK", 10*time.Second, func() bool { _, ok := c.oks[ev.ID]; return ok })
	if r := c.oks[ev.ID]; r[0] != "true" {
		c.t.Fatalf("AUTH refused: %s", r[1])
	}
}

// publish sends ev and returns the OK message, failing when refused.
func (c *snapClient) publish(ev *nostr.Event) string {
	c.t.Helper()
	c.send("EVENT", ev)
	c.waitFor("OK "+ev.ID[:8], 20*time.Second, func() bool { _, ok := c.oks[ev.ID]; return ok })
	r := c.oks[ev.ID]
	if r[0] != "true" {
		c.t.Fatalf("kind %d refused: %s", ev.Kind, r[1])
	}
	return r[1]
}

var snapSubSeq atomic.Int64

// subscribe opens a REQ and waits for EOSE; live events follow on the returned id.
func (c *snapClient) subscribe(f nostr.Filter) string {
	c.t.Helper()
	id := fmt.Sprintf("snap%d", snapSubSeq.Add(1))
	c.send("REQ", id, f)
	c.waitFor("EOSE "+id, 20*time.Second, func() bool { return c.eose[id] })
	return id
}

func (c *snapClient) received(sub string) []*nostr.Event {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.events[sub])
}

var snapNonce atomic.Int64

func snapEvent(t testing.TB, sk string, kind int, content string, tags ...nostr.Tag) *nostr.Event {
	t.Helper()
	tags = append(tags, nostr.Tag{"nonce", fmt.Sprint(snapNonce.Add(1))})
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: tags, Content: content}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// snapHidden returns an event's h tag values, sorted.
func snapHidden(ev *nostr.Event) []string {
	hs := []string{}
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == "h" {
			hs = append(hs, t[1])
		}
	}
	slices.Sort(hs)
	return hs
}

func snapExec(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("exec %q: %v", sql, err)
	}
}

func snapGens(t testing.TB, pool *pgxpool.Pool, viewer string) (target, published int64) {
	t.Helper()
	_ = pool.QueryRow(context.Background(), `SELECT target_generation, published_generation
		FROM buzz.visibility_state WHERE viewer = $1`, viewer).Scan(&target, &published)
	return
}

// snapWait polls cond; the deadline only turns a hang into a failure.
func snapWait(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for: %s", timeout, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// snapHead returns the viewer's only stored 30622 and its hidden set (fails if there are several).
func snapHead(t testing.TB, pool *pgxpool.Pool, viewer string) (*nostr.Event, []string) {
	t.Helper()
	var ids []string
	var raw []byte
	if err := pool.QueryRow(context.Background(), `SELECT array_agg(id), (array_agg(jsonb_build_object(
		  'id', id, 'pubkey', pubkey, 'created_at', created_at, 'kind', kind, 'tags', tags,
		  'content', content, 'sig', sig)))[1]
		FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, viewer).Scan(&ids, &raw); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 {
		t.Fatalf("viewer %.8s has %d snapshot heads", viewer, len(ids))
	}
	ev := &nostr.Event{}
	if err := ev.UnmarshalJSON(raw); err != nil {
		t.Fatal(err)
	}
	if ok, _ := ev.CheckSignature(); !ok || !ev.CheckID() {
		t.Fatalf("snapshot %s: bad id or signature", ev.ID)
	}
	return ev, snapHidden(ev)
}

// snapAudit records every stored 30622 with the generation being published (the trigger runs
// inside publish_visibility_snapshot after its fence UPDATE).
func snapAudit(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	snapExec(t, pool, `
		CREATE TABLE public.snapshot_audit (seq bigserial PRIMARY KEY, viewer text, generation bigint,
		  created_at bigint, hidden text[]);
		CREATE FUNCTION public.snapshot_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  INSERT INTO public.snapshot_audit (viewer, generation, created_at, hidden)
		  SELECT NEW.d_tag, s.published_generation, NEW.created_at,
		         coalesce((SELECT array_agg(t->>1 ORDER BY t->>1) FROM jsonb_array_elements(NEW.tags) t
		                    WHERE t->>0 = 'h'), '{}')
		    FROM buzz.visibility_state s WHERE s.viewer = NEW.d_tag;
		  RETURN NULL;
		END $$;
		CREATE TRIGGER snapshot_audit AFTER INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.kind = 30622) EXECUTE FUNCTION public.snapshot_audit_fn();`)
}

// snapAssertAudit: per viewer, generations and created_at strictly rise in publication order.
func snapAssertAudit(t testing.TB, pool *pgxpool.Pool, viewer string) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT generation, created_at FROM public.snapshot_audit
		WHERE viewer = $1 ORDER BY seq`, viewer)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var gens []int64
	var lastG, lastC int64 = -1, -1
	for rows.Next() {
		var g, c int64
		_ = rows.Scan(&g, &c)
		if g <= lastG || c <= lastC {
			t.Errorf("publication (g %d, created_at %d) after (g %d, created_at %d)", g, c, lastG, lastC)
		}
		gens = append(gens, g)
		lastG, lastC = g, c
	}
	return gens
}

func snapLogHas(r *testenv.Relay, parts ...string) bool {
	for _, line := range strings.Split(r.Log(), "\n") {
		all := true
		for _, p := range parts {
			if !strings.Contains(line, p) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}
