package dm

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

type user struct{ sk, pk string }

func newUser() user { sk, pk := testenv.NewKey(); return user{sk, pk} }

var nonce atomic.Int64

// event signs a new event. Commands carry no content, so two identical commands in one second
// would share an id (and the second be a duplicate); a nonce content keeps test events distinct.
func (u user) event(t testing.TB, kind int, tags nostr.Tags, content string) *nostr.Event {
	t.Helper()
	if content == "" && kind != 5 {
		content = fmt.Sprintf("n%d", nonce.Add(1))
	}
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: tags, Content: content}
	if err := ev.Sign(u.sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// env is one test's view of the package database.
type env struct {
	t    testing.TB
	pool *pgxpool.Pool
	url  string
}

var relaySK, relayPK = testenv.NewKey()

func newEnv(t testing.TB) *env {
	t.Helper()
	url := testenv.DB(t)
	p := testenv.Pool(t, url)
	// The relay key the SQL side recognises (serve writes it at start).
	if _, err := p.Exec(context.Background(), `UPDATE buzz.config SET value=$1 WHERE key='relay_pubkey'`, relayPK); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, pool: p, url: url}
}

func (e *env) accept(ev *nostr.Event) (bool, string) {
	e.t.Helper()
	ok, msg, err := store.Accept(context.Background(), e.pool, ev)
	if err != nil {
		e.t.Fatalf("accept: %v", err)
	}
	return ok, msg
}

// open opens a DM of u with others and returns its channel id.
func (e *env) open(u user, others ...user) string {
	e.t.Helper()
	tags := nostr.Tags{}
	for _, o := range others {
		tags = append(tags, nostr.Tag{"p", o.pk})
	}
	ok, msg := e.accept(u.event(e.t, 41010, tags, ""))
	if !ok || !strings.HasPrefix(msg, "response:") {
		e.t.Fatalf("open: %v %q", ok, msg)
	}
	var resp struct {
		ChannelID string `json:"channel_id"`
		Created   bool   `json:"created"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp); err != nil {
		e.t.Fatal(err)
	}
	return resp.ChannelID
}

func (e *env) hide(u user, ch string) {
	e.t.Helper()
	if ok, msg := e.accept(u.event(e.t, 41012, nostr.Tags{{"h", ch}}, "")); !ok {
		e.t.Fatalf("hide: %q", msg)
	}
}

func (e *env) msg(u user, ch string, kind int) *nostr.Event {
	e.t.Helper()
	ev := u.event(e.t, kind, nostr.Tags{{"h", ch}}, "")
	if ok, m := e.accept(ev); !ok {
		e.t.Fatalf("message kind %d: %q", kind, m)
	}
	return ev
}

func (e *env) hidden(u user, ch string) bool {
	e.t.Helper()
	var h bool
	if err := e.pool.QueryRow(context.Background(),
		`SELECT hidden_at IS NOT NULL FROM buzz.members WHERE channel_id=$1 AND pubkey=$2`, ch, u.pk).Scan(&h); err != nil {
		e.t.Fatalf("hidden(%s): %v", u.pk[:8], err)
	}
	return h
}

// vis returns (target generation, published generation, outbox generation or -1).
func (e *env) vis(u user) (target, published, outbox int64) {
	e.t.Helper()
	outbox = -1
	_ = e.pool.QueryRow(context.Background(),
		`SELECT target_generation, published_generation FROM buzz.visibility_state WHERE viewer=$1`, u.pk).Scan(&target, &published)
	_ = e.pool.QueryRow(context.Background(),
		`SELECT generation FROM buzz.visibility_outbox WHERE viewer=$1`, u.pk).Scan(&outbox)
	return
}

// assertAgree checks the invariant between hidden set, generation and outbox for u: every change
// of the hidden set is one generation, and the outbox row (if any) asks for the current target.
func (e *env) assertAgree(u user, wantTarget int64) {
	e.t.Helper()
	target, _, outbox := e.vis(u)
	if target != wantTarget {
		e.t.Fatalf("viewer %s: target generation %d, want %d", u.pk[:8], target, wantTarget)
	}
	if wantTarget > 0 && outbox != target {
		e.t.Fatalf("viewer %s: outbox generation %d, target %d", u.pk[:8], outbox, target)
	}
}

// session is one dedicated connection with an explicit transaction, for interleavings.
type session struct {
	t    testing.TB
	conn *pgx.Conn
	pid  uint32
	tx   pgx.Tx
}

func (e *env) session(name string) *session {
	e.t.Helper()
	cfg, err := pgx.ParseConfig(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "buzzpg-test-" + name
	c, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { c.Close(context.Background()) })
	return &session{t: e.t, conn: c, pid: c.PgConn().PID()}
}

func (s *session) begin() {
	s.t.Helper()
	tx, err := s.conn.Begin(context.Background())
	if err != nil {
		s.t.Fatal(err)
	}
	s.tx = tx
}

func (s *session) accept(ev *nostr.Event) (bool, string, error) {
	raw, _ := json.Marshal(ev)
	var ok bool
	var msg string
	err := s.tx.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg)
	return ok, msg, err
}

func (s *session) mustAccept(ev *nostr.Event) {
	s.t.Helper()
	ok, msg, err := s.accept(ev)
	must(s.t, ok, msg, err)
}

func (s *session) commit() {
	s.t.Helper()
	if err := s.tx.Commit(context.Background()); err != nil {
		s.t.Fatal(err)
	}
}

// async runs fn in a goroutine and returns a channel closed when it is done.
func async(fn func()) <-chan struct{} {
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	return done
}

// waitBlockedOrDone waits until the backend pid is waiting on a lock (returns true) or done is
// closed (returns false). This is a barrier on observable database state, not a timing guess.
func (e *env) waitBlockedOrDone(pid uint32, done <-chan struct{}) bool {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return false
		default:
		}
		var waiting bool
		_ = e.pool.QueryRow(context.Background(),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid=$1`, pid).Scan(&waiting)
		if waiting {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	e.t.Fatalf("backend %d neither blocked nor done", pid)
	return false
}

func must(t testing.TB, ok bool, msg string, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Fatalf("rejected: %s", msg)
	}
}
