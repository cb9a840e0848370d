package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// testRelay is a real Server on a real listener, over the test package's migrated database.
type testRelay struct {
	s     *Server
	url   string // ws://127.0.0.1:port
	http  string
	pool  *pgxpool.Pool // for test setup and checks
	relay string        // relay secret key

	mu     sync.Mutex
	closed chan closedConn
}

type closedConn struct {
	c      *conn
	reason string
}

func startRelay(t testing.TB, mutate func(*Config)) *testRelay {
	t.Helper()
	dbURL := testenv.DB(t)
	return startRelayOn(t, dbURL, mutate)
}

func startRelayOn(t testing.TB, dbURL string, mutate func(*Config)) *testRelay {
	t.Helper()
	ctx := context.Background()
	accept, err := db.NewPool(ctx, dbURL, "buzzpg-accept:test", 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(accept.Close)
	query, err := db.NewPool(ctx, dbURL, "buzzpg-query:test", 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(query.Close)
	ts := httptest.NewUnstartedServer(nil)
	sk, _ := testenv.NewKey()
	level := slog.LevelWarn
	if os.Getenv("BUZZ_TEST_DEBUG") != "" {
		level = slog.LevelDebug
	}
	cfg := Config{
		RelayURL:       "ws://" + ts.Listener.Addr().String(),
		RelaySecretKey: sk,
		Name:           "test",
		Logger:         slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})),
	}
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := New(cfg, accept, query)
	if err != nil {
		t.Fatal(err)
	}
	tr := &testRelay{s: s, pool: accept, relay: sk, closed: make(chan closedConn, 64)}
	s.onConnClosed = func(c *conn, reason string) {
		select {
		case tr.closed <- closedConn{c, reason}:
		default:
		}
	}
	ts.Config.Handler = s
	ts.Start()
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.Shutdown(sctx)
		ts.Close()
	})
	tr.url = "ws://" + ts.Listener.Addr().String()
	tr.http = "http://" + ts.Listener.Addr().String()
	return tr
}

// client is a raw WebSocket Nostr client: every frame is visible to the test.
type client struct {
	t         testing.TB
	ws        *websocket.Conn
	challenge string
}

const readTimeout = 15 * time.Second

func (tr *testRelay) dial(t testing.TB) *client {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(tr.url, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { ws.Close() })
	c := &client{t: t, ws: ws}
	m := c.read()
	if c.verb(m) != "AUTH" {
		t.Fatalf("first message is not AUTH: %s", m)
	}
	c.challenge = str(m[1])
	return c
}

func (c *client) sendJSON(v ...any) {
	c.t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		c.t.Fatal(err)
	}
	c.sendRaw(b)
}

func (c *client) sendRaw(b []byte) {
	c.t.Helper()
	if err := c.ws.WriteMessage(websocket.TextMessage, b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// read returns the next message; a timeout fails the test (a reply that never comes is a bug).
func (c *client) read() []json.RawMessage {
	c.t.Helper()
	m, err := c.tryRead(readTimeout)
	if err != nil {
		c.t.Fatalf("read: %v", err)
	}
	return m
}

func (c *client) tryRead(d time.Duration) ([]json.RawMessage, error) {
	_ = c.ws.SetReadDeadline(time.Now().Add(d))
	_, b, err := c.ws.ReadMessage()
	if err != nil {
		return nil, err
	}
	var m []json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil || len(m) == 0 {
		return nil, fmt.Errorf("relay sent a non-array message %q", b)
	}
	return m, nil
}

// expectClose1009 reads, dropping whatever comes first, until the relay closes c; the close must
// be 1009 (message too big). what names the frame in the failure.
func (c *client) expectClose1009(t testing.TB, what string) {
	t.Helper()
	for {
		_, err := c.tryRead(readTimeout)
		if err == nil {
			continue
		}
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig {
			t.Fatalf("%s: %v, want close 1009", what, err)
		}
		return
	}
}

// expectTornDown waits for the relay to tear a connection down, for reason.
func (tr *testRelay) expectTornDown(t testing.TB, reason string) {
	t.Helper()
	select {
	case cc := <-tr.closed:
		if cc.reason != reason {
			t.Fatalf("closed: %q, want %s", cc.reason, reason)
		}
	case <-time.After(readTimeout):
		t.Fatal("the connection was not torn down")
	}
}

func (c *client) verb(m []json.RawMessage) string { return str(m[0]) }

func str(r json.RawMessage) string {
	var s string
	_ = json.Unmarshal(r, &s)
	return s
}

// expect reads the next message and checks its verb.
func (c *client) expect(verb string) []json.RawMessage {
	c.t.Helper()
	m := c.read()
	if c.verb(m) != verb {
		c.t.Fatalf("expected %s, got %s", verb, joinRaw(m))
	}
	return m
}

func joinRaw(m []json.RawMessage) string {
	parts := make([]string, len(m))
	for i, p := range m {
		parts[i] = string(p)
	}
	return "[" + strings.Join(parts, ",") + "]"
}

type okReply struct {
	id  string
	ok  bool
	msg string
}

func parseOK(t testing.TB, m []json.RawMessage) okReply {
	t.Helper()
	if len(m) != 4 {
		t.Fatalf("OK with %d elements: %s", len(m), joinRaw(m))
	}
	var ok bool
	if err := json.Unmarshal(m[2], &ok); err != nil {
		t.Fatalf("OK flag: %s", joinRaw(m))
	}
	return okReply{id: str(m[1]), ok: ok, msg: str(m[3])}
}

// publish sends an EVENT and returns its OK.
func (c *client) publish(ev nostr.Event) okReply {
	c.t.Helper()
	c.sendJSON("EVENT", ev)
	r := parseOK(c.t, c.expect("OK"))
	if r.id != ev.ID {
		c.t.Fatalf("OK for %s, expected %s", r.id, ev.ID)
	}
	return r
}

func (c *client) mustPublish(ev nostr.Event) {
	c.t.Helper()
	if r := c.publish(ev); !r.ok {
		c.t.Fatalf("publish kind %d: %s", ev.Kind, r.msg)
	}
}

// req subscribes and returns the stored events up to EOSE (failing on CLOSED).
func (c *client) req(subID string, filters ...nostr.Filter) []nostr.Event {
	c.t.Helper()
	evs, closed := c.reqOrClosed(subID, filters...)
	if closed != "" {
		c.t.Fatalf("REQ %s closed: %s", subID, closed)
	}
	return evs
}

func (c *client) reqOrClosed(subID string, filters ...nostr.Filter) ([]nostr.Event, string) {
	c.t.Helper()
	msg := []any{"REQ", subID}
	for _, f := range filters {
		msg = append(msg, f)
	}
	c.sendJSON(msg...)
	return c.collect(subID)
}

// collect reads EVENTs of subID until EOSE or CLOSED.
func (c *client) collect(subID string) ([]nostr.Event, string) {
	c.t.Helper()
	var out []nostr.Event
	for {
		m := c.read()
		switch c.verb(m) {
		case "EVENT":
			if str(m[1]) != subID {
				continue
			}
			var ev nostr.Event
			if err := json.Unmarshal(m[2], &ev); err != nil {
				c.t.Fatalf("bad EVENT: %v", err)
			}
			out = append(out, ev)
		case "EOSE":
			if str(m[1]) == subID {
				return out, ""
			}
		case "CLOSED":
			if str(m[1]) == subID {
				return out, str(m[2])
			}
		}
	}
}

// nextEvent reads until an EVENT for subID arrives.
func (c *client) nextEvent(subID string) nostr.Event {
	c.t.Helper()
	for {
		m := c.read()
		if c.verb(m) == "EVENT" && str(m[1]) == subID {
			var ev nostr.Event
			if err := json.Unmarshal(m[2], &ev); err != nil {
				c.t.Fatal(err)
			}
			return ev
		}
	}
}

func (c *client) count(subID string, filters ...nostr.Filter) (int64, string) {
	c.t.Helper()
	msg := []any{"COUNT", subID}
	for _, f := range filters {
		msg = append(msg, f)
	}
	c.sendJSON(msg...)
	for {
		m := c.read()
		switch c.verb(m) {
		case "COUNT":
			var body struct {
				Count int64 `json:"count"`
			}
			if err := json.Unmarshal(m[2], &body); err != nil {
				c.t.Fatal(err)
			}
			return body.Count, ""
		case "CLOSED":
			return -1, str(m[2])
		}
	}
}

// auth authenticates as sk on this connection.
func (c *client) auth(sk, relayURL string) okReply {
	c.t.Helper()
	ev := authEvent(sk, c.challenge, relayURL, nostr.Now())
	c.sendJSON("AUTH", ev)
	return parseOK(c.t, c.expect("OK"))
}

func (c *client) mustAuth(sk, relayURL string) {
	c.t.Helper()
	if r := c.auth(sk, relayURL); !r.ok {
		c.t.Fatalf("AUTH failed: %s", r.msg)
	}
}

func authEvent(sk, challenge, relayURL string, at nostr.Timestamp) nostr.Event {
	ev := nostr.Event{Kind: 22242, CreatedAt: at, Tags: nostr.Tags{{"relay", relayURL}, {"challenge", challenge}}}
	if err := ev.Sign(sk); err != nil {
		panic(err)
	}
	return ev
}

// signed builds and signs an event.
func signed(sk string, kind int, content string, createdAt nostr.Timestamp, tags ...nostr.Tag) nostr.Event {
	ev := nostr.Event{Kind: kind, Content: content, CreatedAt: createdAt, Tags: nostr.Tags(tags)}
	if ev.Tags == nil {
		ev.Tags = nostr.Tags{}
	}
	if err := ev.Sign(sk); err != nil {
		panic(err)
	}
	return ev
}

func ids(evs []nostr.Event) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.ID
	}
	return out
}

func sameIDs(t testing.TB, what string, got []nostr.Event, want ...nostr.Event) {
	t.Helper()
	g, w := ids(got), ids(want)
	if strings.Join(g, ",") != strings.Join(w, ",") {
		t.Fatalf("%s: got %d events %v\nwant %d events %v", what, len(g), short(g), len(w), short(w))
	}
}

func short(ids []string) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id[:8]
	}
	return out
}

func ts(v int64) *nostr.Timestamp { t := nostr.Timestamp(v); return &t }

// eventCount counts stored rows of a pubkey (to check that a refused EVENT changed nothing).
func (tr *testRelay) eventCount(t testing.TB, where string, args ...any) int {
	t.Helper()
	var n int
	if err := tr.pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE `+where, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// holdAll takes every connection of pool (so nothing else can run on it) and returns the release.
func holdAll(t testing.TB, pool *pgxpool.Pool) (release func()) {
	t.Helper()
	var held []*pgxpool.Conn
	for i := int32(0); i < pool.Config().MaxConns; i++ {
		conn, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, conn)
	}
	return func() {
		for _, h := range held {
			h.Release()
		}
	}
}

// publicDelivery is a live delivery of a public event (what the fan-out hands over for one).
func publicDelivery(ev *nostr.Event) evt.Delivery {
	return evt.Delivery{Event: ev, Scope: evt.Scope{Kind: evt.ScopePublic}}
}

// drainInboxes matches every live delivery handed over so far, for tests that look at a send
// queue right after DeliverEvent: each connection matches on its own goroutine (inbox.go).
func (s *Server) drainInboxes() {
	for _, c := range s.snapshotConns() {
		c.drainInbox(nil)
	}
}

// expectInboxClose waits for c (described as who) to be closed for its overflowing inbox, the one
// close counted since before (SlowClientsClosed{inbox}).
func (tr *testRelay) expectInboxClose(t *testing.T, c *conn, who string, before float64) {
	t.Helper()
	select {
	case cc := <-tr.closed:
		if cc.c != c || cc.reason != "send queue overflow" {
			t.Fatalf("closed conn %d (%q), want %s for its inbox", cc.c.id, cc.reason, who)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s was not closed", who)
	}
	if n := testutil.ToFloat64(metrics.SlowClientsClosed.WithLabelValues("inbox")) - before; n != 1 {
		t.Fatalf("inbox closes counted %v, want 1", n)
	}
}
