package store_test

// buzz.accept_events stores runs of plain events set-based (sql/0002_accept.up.sql,
// accept_plain_run) and every other event through accept_event. This test feeds one mixed corpus
// to accept_event, one event per call, in one database, and to accept_events in batches in
// another, and asserts the same verdict for every event and the same stored state.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// rawVerdict is one event's outcome as SQL gives it: accept_events' row, or accept_event's row
// or raised client error.
type rawVerdict struct {
	OK   bool
	Msg  string
	Code string
}

const diffChannel = "0b0e5a6c-7a1f-4f51-9a53-5b1f6f0d2a11"

// diffSetup gives a database the same starting state: a DM of a and b with a fixed id (a DM
// opened by accept_event gets a random one, which would show in verdicts).
func diffSetup(t *testing.T, pool *pgxpool.Pool, a, b string) {
	t.Helper()
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO buzz.channels (id, participant_hash, created_by)
		VALUES ($1, buzz.participant_hash(ARRAY[$2, $3]), $2)`, diffChannel, a, b); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO buzz.members (channel_id, pubkey) VALUES ($1, $2), ($1, $3)`,
		diffChannel, a, b); err != nil {
		t.Fatal(err)
	}
}

// rawEvent is a signed event as a JSON object with one field changed (shape errors the relay
// would refuse before SQL; accept_events' callers may still send them).
func rawEvent(t *testing.T, ev *nostr.Event, field string, value any) json.RawMessage {
	t.Helper()
	var m map[string]any
	b, _ := json.Marshal(ev)
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	m[field] = value
	out, _ := json.Marshal(m)
	return out
}

func evJSON(ev *nostr.Event) json.RawMessage { b, _ := json.Marshal(ev); return b }

// diffCorpus is a setup prefix (stored one by one in both databases) and the corpus proper.
func diffCorpus(t *testing.T) (prefix, corpus []json.RawMessage) {
	a, b, c := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()
	now := nostr.Now()
	stored := a.Event(t, 1, nil, "stored before")
	tombstoned := a.Event(t, 1, nil, "deleted before it came")
	deletedBefore := a.Event(t, 5, nostr.Tags{{"e", tombstoned.ID}}, "")
	foreignTomb := b.Event(t, 5, nostr.Tags{{"e", stored.ID}}, "") // someone else's id: no effect
	prefix = []json.RawMessage{evJSON(stored), evJSON(deletedBefore), evJSON(foreignTomb)}

	p1 := a.Event(t, 1, nostr.Tags{{"t", "b"}, {"t", "a"}, {"p", b.PK}, {"t", "b"}, {"e", stored.ID}, {"expiration"}}, "p1")
	p2 := b.Event(t, 1, nil, "p2")
	p3 := c.Event(t, 1, nil, "p3 deleted later in the batch")
	del3 := c.Event(t, 5, nostr.Tags{{"e", p3.ID}}, "")
	p4 := b.Event(t, 1, nil, "p4 deleted before it came")
	del4 := b.Event(t, 5, nostr.Tags{{"e", p4.ID}}, "")
	hide := b.Event(t, 41012, nostr.Tags{{"h", diffChannel}}, "")
	dm := a.Event(t, 9, nostr.Tags{{"h", diffChannel}}, "resurfaces b")
	long := make([]byte, 9000)
	for i := range long {
		long[i] = "0123456789abcdef"[(i*7919+i/13)%16]
	}
	tooLong := a.Event(t, 1, nostr.Tags{{"t", string(long)}}, "tag too long to index")
	expirer := a.Event(t, 1, nostr.Tags{{"expiration", fmt.Sprint(now + 3600)}}, "expires later")
	ev := func(e *nostr.Event) json.RawMessage { return evJSON(e) }
	corpus = []json.RawMessage{
		ev(p1), ev(p2), ev(p1), // a duplicate within the batch
		ev(stored), ev(tombstoned), // a duplicate of a stored event; a deleted id
		ev(a.Event(t, 1, nostr.Tags{{"expiration", fmt.Sprint(now - 10)}}, "expired")),
		ev(a.EventAt(t, 1, nil, "from the future", now+3600)),
		ev(expirer),
		ev(a.Event(t, 1, nostr.Tags{{"expiration", "soon"}}, "bad expiration")),
		ev(p3), ev(del3), ev(p3), // stored, deleted later in the batch, refused after
		ev(del4), ev(p4), // a tombstone in the batch before its event
		ev(a.EventAt(t, 0, nil, `{"name":"a"}`, now-5)), ev(a.EventAt(t, 0, nil, `{"name":"old"}`, now-50)),
		ev(a.Event(t, 30023, nostr.Tags{{"d", "x"}}, "addressable")),
		ev(hide), ev(dm), // b hides the DM, a's message resurfaces it
		ev(a.Event(t, 1, nostr.Tags{{"h", diffChannel}}, "channel note")),
		ev(c.Event(t, 1, nostr.Tags{{"h", diffChannel}}, "not a member")),
		ev(a.Event(t, 41010, nostr.Tags{{"p", b.PK}}, "")),
		ev(a.Event(t, 20001, nil, "ephemeral")),
		ev(a.Event(t, 1059, nostr.Tags{{"p", b.PK}}, "wrap")),
		ev(a.Event(t, 1059, nostr.Tags{{"p", b.PK}, {"p", c.PK}}, "wrap for two")),
		ev(a.Event(t, 22242, nil, "auth")),
		ev(a.Event(t, 1, nostr.Tags{{"h"}}, "empty h tag")),
		rawEvent(t, c.Event(t, 1, nil, "bad sig"), "sig", "xyz"),
		rawEvent(t, c.Event(t, 1, nil, "bad tags"), "tags", []any{[]any{}}),
		rawEvent(t, c.Event(t, 1, nil, "number tag"), "tags", []any{[]any{"t", 1}}),
		rawEvent(t, c.Event(t, 1, nil, "fraction"), "kind", 1.5),
		rawEvent(t, c.Event(t, 1, nil, "negative"), "created_at", -1),
		rawEvent(t, c.Event(t, 1, nil, "string kind"), "kind", "1"),
		json.RawMessage(`"not an object"`),
		ev(c.Event(t, 1, nil, "before the long one")), ev(tooLong), ev(c.Event(t, 1, nil, "after the long one")),
		ev(c.Event(t, 7, nostr.Tags{{"e", p2.ID}}, "+")), ev(b.Event(t, 1, nil, "last")),
	}
	return prefix, corpus
}

// oneByOne runs each event through accept_event in its own transaction.
func oneByOne(t *testing.T, pool *pgxpool.Pool, evs []json.RawMessage) []rawVerdict {
	t.Helper()
	var out []rawVerdict
	for _, raw := range evs {
		var v rawVerdict
		err := pool.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&v.OK, &v.Msg)
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr):
			v = rawVerdict{false, pgErr.Message, pgErr.Code}
		case err != nil:
			t.Fatal(err)
		}
		out = append(out, v)
	}
	return out
}

// inBatches runs the events through accept_events, size events per call.
func inBatches(t *testing.T, pool *pgxpool.Pool, evs []json.RawMessage, size int) []rawVerdict {
	t.Helper()
	var out []rawVerdict
	for len(evs) > 0 {
		n := min(size, len(evs))
		arr, _ := json.Marshal(evs[:n])
		rows, err := pool.Query(context.Background(), `SELECT ok, message, coalesce(code, '') FROM buzz.accept_events($1::jsonb)`, string(arr))
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var v rawVerdict
			if err := rows.Scan(&v.OK, &v.Msg, &v.Code); err != nil {
				t.Fatal(err)
			}
			out = append(out, v)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		evs = evs[n:]
	}
	return out
}

// storedState is every row acceptance writes, as text, without the times it stamps.
func storedState(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var parts []string
	for _, q := range []string{
		`SELECT id, pubkey, created_at, kind, tags, content, sig, d_tag, tagvals, h, expires_at, scope, scope_p, channel_id
		   FROM buzz.events ORDER BY id`,
		`SELECT id, pubkey, deleted_by FROM buzz.deleted_ids ORDER BY id, pubkey`,
		`SELECT kind, pubkey, d_tag, until_created_at FROM buzz.deleted_addresses ORDER BY 1, 2, 3`,
		`SELECT channel_id, pubkey, hidden_at IS NOT NULL FROM buzz.members ORDER BY 1, 2`,
		`SELECT viewer, target_generation, published_generation FROM buzz.visibility_state ORDER BY 1`,
		`SELECT viewer, generation FROM buzz.visibility_outbox ORDER BY 1`,
		`SELECT id, state FROM buzz.reminders ORDER BY 1`,
	} {
		rows, err := pool.Query(context.Background(), `SELECT coalesce(string_agg(r::text, E'\n'), '') FROM (`+q+`) r`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				t.Fatal(err)
			}
			parts = append(parts, s)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
	}
	return strings.Join(parts, "\n--\n")
}

func TestAcceptEventsMatchesAcceptEvent(t *testing.T) {
	prefix, corpus := diffCorpus(t)
	var a, b map[string]any
	_ = json.Unmarshal(prefix[0], &a)
	_ = json.Unmarshal(prefix[2], &b)
	for _, size := range []int{60, 7, 1} {
		t.Run(fmt.Sprintf("batch=%d", size), func(t *testing.T) {
			one, set := testenv.Pool(t, testenv.FreshDB(t)), testenv.Pool(t, testenv.FreshDB(t))
			for _, p := range []*pgxpool.Pool{one, set} {
				diffSetup(t, p, a["pubkey"].(string), b["pubkey"].(string))
				oneByOne(t, p, prefix)
			}
			want := oneByOne(t, one, corpus)
			got := inBatches(t, set, corpus, size)
			if len(got) != len(want) {
				t.Fatalf("%d verdicts, want %d", len(got), len(want))
			}
			for i := range want {
				if got[i] != want[i] {
					t.Errorf("event %d (%.80s): accept_events %+v, accept_event %+v", i, corpus[i], got[i], want[i])
				}
			}
			if s1, s2 := storedState(t, one), storedState(t, set); s1 != s2 {
				t.Errorf("stored state differs:\naccept_event:\n%s\naccept_events:\n%s", s1, s2)
			}
		})
	}
}
