package tests

// buzz.accept_events (sql/0002_accept.up.sql) accepts several events in one transaction, each as accept_event
// in its own subtransaction. What the batch must not change: the durability of a stored event
// (an ephemeral event turns synchronous_commit off for its transaction), the session's own
// lock_timeout, and PostgreSQL's subtransaction cache (at most 60 subtransactions).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func batchJSON(t *testing.T, evs ...*nostr.Event) string {
	t.Helper()
	raw, err := json.Marshal(evs)
	if err != nil {
		t.Fatal(err)
	}
	return string(raw)
}

// settingAfterBatch runs accept_events in a transaction and returns a setting as the rest of that
// transaction (its COMMIT included) sees it.
func settingAfterBatch(t *testing.T, url, setting, evs string, lockWaitMs int) string {
	t.Helper()
	s := testenv.NewSession(t, url, "batch")
	s.Begin()
	defer s.Rollback()
	ctx := context.Background()
	rows, err := s.Tx.Query(ctx, `SELECT ok, message FROM buzz.accept_events($1::jsonb, $2)`, evs, lockWaitMs)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var ok bool
		var msg string
		if err := rows.Scan(&ok, &msg); err != nil {
			t.Fatal(err)
		}
		if !ok || msg != "" {
			t.Fatalf("refused: %q", msg)
		}
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	var v string
	if err := s.Tx.QueryRow(ctx, `SELECT current_setting($1)`, setting).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// An ephemeral event may skip the WAL flush wait (it is never stored); an event stored in the
// same transaction may not: its OK would go out before it is durable.
func TestAcceptEventsKeepsStoredEventsDurable(t *testing.T) {
	url := testenv.FreshDB(t)
	u := testenv.NewUser()
	eph := func() *nostr.Event { return u.Event(t, 20001, nil, "typing") }
	stored := func() *nostr.Event { return u.Event(t, 1, nil, "kept") }
	cases := []struct {
		name string
		evs  []*nostr.Event
		want string
	}{
		{"ephemeral then stored", []*nostr.Event{eph(), stored()}, "on"},
		{"stored then ephemeral", []*nostr.Event{stored(), eph()}, "on"},
		{"ephemeral only", []*nostr.Event{eph(), eph()}, "off"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := settingAfterBatch(t, url, "synchronous_commit", batchJSON(t, tc.evs...), 0); got != tc.want {
				t.Fatalf("synchronous_commit at COMMIT: %s, want %s", got, tc.want)
			}
		})
	}
}

// lock_wait_ms bounds the call's lock waits only: the rest of the caller's transaction keeps its
// own lock_timeout.
func TestAcceptEventsRestoresLockTimeout(t *testing.T) {
	url := testenv.FreshDB(t)
	u := testenv.NewUser()
	if got := settingAfterBatch(t, url, "lock_timeout", batchJSON(t, u.Event(t, 1, nil, "x")), 50); got != "0" {
		t.Fatalf("lock_timeout after the call: %s, want 0", got)
	}
}

func TestAcceptEventsRefusesBadCalls(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	u := testenv.NewUser()
	var many, lists, mixed []*nostr.Event
	for i := range 121 {
		many = append(many, u.Event(t, 1, nil, ""))
		if i < 61 {
			lists = append(lists, u.Event(t, 10002, nil, "")) // replaceable: each stored alone
		}
		if i < 62 {
			mixed = append(mixed, u.Event(t, []int{1, 10002}[i%2], nil, ""))
		}
	}
	for _, tc := range []struct {
		name, evs string
		lockWait  int
		want      string
	}{
		{"121 events", batchJSON(t, many...), 0, "invalid: at most 120 events per accept_events call"},
		{"61 events stored alone", batchJSON(t, lists...), 0, "invalid: more than 60 subtransactions"},
		{"31 runs and 31 events alone", batchJSON(t, mixed...), 0, "invalid: more than 60 subtransactions"},
		{"not an array", `{"kind":1}`, 0, "invalid: accept_events takes a JSON array of events"},
		{"negative lock wait", batchJSON(t, many[0]), -1, "invalid: lock_wait_ms must be 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pool.Exec(context.Background(), `SELECT * FROM buzz.accept_events($1::jsonb, $2)`, tc.evs, tc.lockWait)
			var pgErr *pgconn.PgError
			if !errors.As(err, &pgErr) || pgErr.Code != "BZ400" || !strings.HasPrefix(pgErr.Message, tc.want) {
				t.Fatalf("got %v, want BZ400 %q", err, tc.want)
			}
		})
	}
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE pubkey = $1`, u.PK).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d events stored by refused calls", n)
	}
}

// A run of plain events is stored by a plain INSERT: the event:<id> locks and the look-up of
// stored ids settle duplicates (sql/0002_accept.up.sql, accept_plain_run). A writer that takes no
// lock (psql) may still store one of the run's ids meanwhile: the primary key then refuses the
// run, and accept_events gives each of its events accept_event's verdict instead of failing.
func TestAcceptEventsRunMeetsAWriterWithoutTheLock(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	u := testenv.NewUser()
	taken, other := u.Event(t, 1, nil, "taken meanwhile"), u.Event(t, 1, nil, "other")

	w := testenv.NewSession(t, url, "unlocked-writer")
	w.Begin()
	if _, err := w.Tx.Exec(ctx, `INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig)
		VALUES ($1, $2, $3, 1, '[]', $4, $5)`, taken.ID, taken.PubKey, int64(taken.CreatedAt), taken.Content, taken.Sig); err != nil {
		t.Fatal(err)
	}
	r := testenv.NewSession(t, url, "batch")
	type verdict struct {
		ok  bool
		msg string
	}
	var got []verdict
	var callErr error
	done := testenv.Async(func() {
		rows, err := r.Conn.Query(ctx, `SELECT ok, message FROM buzz.accept_events($1::jsonb)`, batchJSON(t, taken, other))
		if err != nil {
			callErr = err
			return
		}
		for rows.Next() {
			var v verdict
			if err := rows.Scan(&v.ok, &v.msg); err != nil {
				callErr = err
				return
			}
			got = append(got, v)
		}
		callErr = rows.Err()
	})
	// The run has not seen the uncommitted row and waits on it in events_pkey.
	if !testenv.WaitBlockedOrDone(t, pool, r.PID, done) {
		t.Fatalf("the run did not wait for the writer (err %v, verdicts %v)", callErr, got)
	}
	w.Commit()
	<-done
	if callErr != nil {
		t.Fatalf("accept_events failed: %v", callErr)
	}
	want := []verdict{{true, "duplicate: already have this event"}, {true, ""}}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("verdicts %v, want %v", got, want)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM buzz.events WHERE id = ANY($1)`, []string{taken.ID, other.ID}).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 2 {
		t.Fatalf("%d of the 2 events stored", n)
	}
}

// A run looks up stored ids and tombstones by index probes at any table size. An EXISTS in a
// select list may otherwise become a hashed subplan, which reads the whole table once per call: a
// generic plan made while the table was small (a fresh relay, never analyzed) then scans every
// stored event in every later call.
func TestAcceptPlainRunProbesByIndex(t *testing.T) {
	url := testenv.FreshDB(t)
	ctx := context.Background()
	u := testenv.NewUser()
	s := testenv.NewSession(t, url, "batch")
	// Statistics of a table of one row, and one plan for every call: the planner's best case for a
	// hashed subplan.
	if _, err := s.Conn.Exec(ctx, `SELECT count(*) FROM buzz.accept_events($1::jsonb)`,
		batchJSON(t, u.Event(t, 1, nil, "the first"))); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Conn.Exec(ctx, `ANALYZE buzz.events; ANALYZE buzz.deleted_ids; SET plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	for call := range 3 {
		evs := make([]*nostr.Event, 50)
		for i := range evs {
			evs[i] = u.Event(t, 1, nil, fmt.Sprint("probe ", call, " ", i))
		}
		s.Begin()
		if _, err := s.Tx.Exec(ctx, `SELECT count(*) FROM buzz.accept_events($1::jsonb)`, batchJSON(t, evs...)); err != nil {
			t.Fatal(err)
		}
		var seq, idx int64
		if err := s.Tx.QueryRow(ctx, `SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables
			WHERE relid = 'buzz.events'::regclass`).Scan(&seq, &idx); err != nil {
			t.Fatal(err)
		}
		s.Commit()
		if seq != 0 {
			t.Fatalf("call %d scanned buzz.events sequentially %d times (index scans %d)", call, seq, idx)
		}
	}
}
