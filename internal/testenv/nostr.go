package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
)

// User is a test identity.
type User struct{ SK, PK string }

// NewUser makes a fresh identity.
func NewUser() User { sk, pk := NewKey(); return User{sk, pk} }

var nonce atomic.Int64

// Event signs a new event by u. Commands carry no content, so two identical commands in one
// second would share an id (the second a duplicate); an empty content becomes a nonce so test
// events stay distinct. Kind 5 keeps its empty content.
func (u User) Event(t testing.TB, kind int, tags nostr.Tags, content string) *nostr.Event {
	t.Helper()
	if content == "" && kind != 5 && kind != 22242 {
		content = fmt.Sprintf("n%d", nonce.Add(1))
	}
	return u.EventAt(t, kind, tags, content, nostr.Now())
}

// EventAt signs an event with an explicit created_at and content as given.
func (u User) EventAt(t testing.TB, kind int, tags nostr.Tags, content string, at nostr.Timestamp) *nostr.Event {
	t.Helper()
	if tags == nil {
		tags = nostr.Tags{}
	}
	ev := &nostr.Event{Kind: kind, CreatedAt: at, Tags: tags, Content: content}
	if err := ev.Sign(u.SK); err != nil {
		t.Fatal(err)
	}
	return ev
}

// Session is one dedicated connection with an explicit transaction, for driving interleavings
// step by step like PostgreSQL's isolation tests.
type Session struct {
	t    testing.TB
	Conn *pgx.Conn
	PID  uint32
	Tx   pgx.Tx
}

// NewSession connects to url with application_name buzzpg-test-<name>.
func NewSession(t testing.TB, url, name string) *Session {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "buzzpg-test-" + name
	c, err := pgx.ConnectConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return &Session{t: t, Conn: c, PID: c.PgConn().PID()}
}

// Begin opens the session's transaction.
func (s *Session) Begin() {
	s.t.Helper()
	tx, err := s.Conn.Begin(context.Background())
	if err != nil {
		s.t.Fatal(err)
	}
	s.Tx = tx
}

// Accept calls buzz.accept_event inside the session's transaction.
func (s *Session) Accept(ev *nostr.Event) (bool, string, error) {
	raw, _ := json.Marshal(ev)
	var ok bool
	var msg string
	err := s.Tx.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg)
	return ok, msg, err
}

// MustAccept is Accept that fails the test on an error or a rejection.
func (s *Session) MustAccept(ev *nostr.Event) {
	s.t.Helper()
	ok, msg, err := s.Accept(ev)
	if err != nil {
		s.t.Error(err)
	} else if !ok {
		s.t.Errorf("rejected: %s", msg)
	}
}

// Commit commits the session's transaction.
func (s *Session) Commit() {
	s.t.Helper()
	if err := s.Tx.Commit(context.Background()); err != nil {
		s.t.Error(err)
	}
}

// Rollback ends the session's transaction without committing it.
func (s *Session) Rollback() {
	s.t.Helper()
	if err := s.Tx.Rollback(context.Background()); err != nil {
		s.t.Error(err)
	}
}

// Async runs fn in a goroutine and returns a channel closed when it is done.
func Async(fn func()) <-chan struct{} {
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	return done
}

// WaitBlockedOrDone waits until backend pid waits on a lock (true) or done is closed (false):
// a barrier on observable database state, not a timing guess.
func WaitBlockedOrDone(t testing.TB, pool *pgxpool.Pool, pid uint32, done <-chan struct{}) bool {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			return false
		default:
		}
		var waiting bool
		_ = pool.QueryRow(context.Background(),
			`SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid=$1`, pid).Scan(&waiting)
		if waiting {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("backend %d neither blocked nor done", pid)
	return false
}
