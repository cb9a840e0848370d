package dm

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

type user = testenv.User

func newUser() user { return testenv.NewUser() }

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
		tags = append(tags, nostr.Tag{"p", o.PK})
	}
	ok, msg := e.accept(u.Event(e.t, 41010, tags, ""))
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
	if ok, msg := e.accept(u.Event(e.t, 41012, nostr.Tags{{"h", ch}}, "")); !ok {
		e.t.Fatalf("hide: %q", msg)
	}
}

func (e *env) msg(u user, ch string, kind int) *nostr.Event {
	e.t.Helper()
	ev := u.Event(e.t, kind, nostr.Tags{{"h", ch}}, "")
	if ok, m := e.accept(ev); !ok {
		e.t.Fatalf("message kind %d: %q", kind, m)
	}
	return ev
}

func (e *env) hidden(u user, ch string) bool {
	e.t.Helper()
	var h bool
	if err := e.pool.QueryRow(context.Background(),
		`SELECT hidden_at IS NOT NULL FROM buzz.members WHERE channel_id=$1 AND pubkey=$2`, ch, u.PK).Scan(&h); err != nil {
		e.t.Fatalf("hidden(%s): %v", u.PK[:8], err)
	}
	return h
}

// vis returns (target generation, published generation, outbox generation or -1).
func (e *env) vis(u user) (target, published, outbox int64) {
	e.t.Helper()
	outbox = -1
	// No row is a legitimate answer (0, 0 and -1); any other error fails the test instead of
	// reading as "no outbox row".
	for _, q := range []struct {
		sql  string
		dest []any
	}{
		{`SELECT target_generation, published_generation FROM buzz.visibility_state WHERE viewer=$1`, []any{&target, &published}},
		{`SELECT generation FROM buzz.visibility_outbox WHERE viewer=$1`, []any{&outbox}},
	} {
		if err := e.pool.QueryRow(context.Background(), q.sql, u.PK).Scan(q.dest...); err != nil && !errors.Is(err, pgx.ErrNoRows) {
			e.t.Fatalf("%s: %v", q.sql, err)
		}
	}
	return
}

// assertAgree checks the invariant between hidden set, generation and outbox for u: every change
// of the hidden set is one generation, and the outbox row (if any) asks for the current target.
func (e *env) assertAgree(u user, wantTarget int64) {
	e.t.Helper()
	target, _, outbox := e.vis(u)
	if target != wantTarget {
		e.t.Fatalf("viewer %s: target generation %d, want %d", u.PK[:8], target, wantTarget)
	}
	if wantTarget > 0 && outbox != target {
		e.t.Fatalf("viewer %s: outbox generation %d, target %d", u.PK[:8], outbox, target)
	}
}

func (e *env) session(name string) *testenv.Session { return testenv.NewSession(e.t, e.url, name) }

func (e *env) waitBlockedOrDone(pid uint32, done <-chan struct{}) bool {
	return testenv.WaitBlockedOrDone(e.t, e.pool, pid, done)
}

var async = testenv.Async

func must(t testing.TB, ok bool, msg string, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Fatalf("rejected: %s", msg)
	}
}
