package dm

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
)

// storedCount counts the stored rows of event id (checking the query itself).
func (e *env) storedCount(id string) int {
	e.t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE id=$1`, id).Scan(&n); err != nil {
		e.t.Fatalf("count events %.8s: %v", id, err)
	}
	return n
}

// I1: acceptance and its visibility consequence commit together or not at all.
func TestAcceptAndOutboxCommitTogether(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	e.hide(b, ch)
	e.assertAgree(b, 1)

	// Make the outbox write fail for b only (other tests share the database).
	_, err := e.pool.Exec(ctx, `
		CREATE FUNCTION pg_temp_fail_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'outbox write failed (test)'; END $$;
		CREATE TRIGGER test_fail_outbox BEFORE INSERT OR UPDATE ON buzz.visibility_outbox
		  FOR EACH ROW WHEN (NEW.viewer = '`+b.PK+`') EXECUTE FUNCTION pg_temp_fail_outbox();`)
	if err != nil {
		t.Fatal(err)
	}
	cleanup := func() {
		_, _ = e.pool.Exec(ctx, `DROP TRIGGER IF EXISTS test_fail_outbox ON buzz.visibility_outbox; DROP FUNCTION IF EXISTS pg_temp_fail_outbox()`)
	}
	t.Cleanup(cleanup)

	m := a.Event(t, 9, nostr.Tags{{"h", ch}}, "are you there?")
	ok, msg, err := store.Accept(ctx, e.pool, m)
	if err == nil || ok {
		t.Fatalf("accept must fail when the outbox write fails: ok=%v msg=%q err=%v", ok, msg, err)
	}
	if e.storedCount(m.ID) != 0 {
		t.Fatal("I1 broken: the message was stored although its visibility consequence failed")
	}
	if !e.hidden(b, ch) {
		t.Fatal("I1 broken: the hide was cleared although the outbox write failed")
	}
	e.assertAgree(b, 1)

	cleanup()
	ok, msg = e.accept(m)
	if !ok || msg != "" {
		t.Fatalf("resend: %v %q", ok, msg)
	}
	if n := e.storedCount(m.ID); n != 1 || e.hidden(b, ch) {
		t.Fatalf("after resend: stored %d, hidden %v", n, e.hidden(b, ch))
	}
	e.assertAgree(b, 2)
	if ok, msg := e.accept(m); !ok || !strings.HasPrefix(msg, "duplicate:") {
		t.Fatalf("third send: %v %q", ok, msg)
	}
}

// visibilityRows returns u's visibility_state row and outbox row, whole, as text ("" for no
// outbox row): any change to either shows.
func (e *env) visibilityRows(u user) (state, outbox string) {
	e.t.Helper()
	err := e.pool.QueryRow(context.Background(), `
		SELECT s::text, coalesce((SELECT o::text FROM buzz.visibility_outbox o WHERE o.viewer = s.viewer), '')
		  FROM buzz.visibility_state s WHERE s.viewer = $1`, u.PK).Scan(&state, &outbox)
	if err != nil {
		e.t.Fatalf("visibility rows of %.8s: %v", u.PK, err)
	}
	return state, outbox
}

// I1, the other side: the EVENT insert fails while the message's visibility consequence (the
// recipient's hide cleared, the generation bumped, the outbox row upserted, NOTIFY queued) is in
// flight. Nothing of that consequence may survive: the hide stays, generation and outbox row are
// exactly as before, and no notification is delivered. TestAcceptAndOutboxCommitTogether fails
// the consequence and checks the event; this fails the event and checks the consequence.
//
//   - "before insert": a BEFORE INSERT trigger on buzz.events refuses the message's row.
//   - "at commit": a deferred constraint trigger refuses the row at COMMIT, after accept_event has
//     already cleared the hide, bumped the generation and upserted the outbox row in the same
//     transaction (accept_event stores the event first, then resurfaces).
func TestAcceptEventInsertFailureKeepsTheHide(t *testing.T) {
	cases := []struct {
		name     string
		inFlight string // b's state inside the failing transaction when the insert fails
		trigger  func(id string) string
	}{
		{"before insert", "t, b target: 1", func(id string) string {
			return `CREATE TRIGGER test_fail_event BEFORE INSERT ON buzz.events
			  FOR EACH ROW WHEN (NEW.id = '` + id + `') EXECUTE FUNCTION public.test_fail_event()`
		}},
		{"at commit", "f, b target: 2", func(id string) string {
			return `CREATE CONSTRAINT TRIGGER test_fail_event AFTER INSERT ON buzz.events
			  DEFERRABLE INITIALLY DEFERRED
			  FOR EACH ROW WHEN (NEW.id = '` + id + `') EXECUTE FUNCTION public.test_fail_event()`
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			a, b := newUser(), newUser()
			ch := e.open(a, b)
			e.hide(b, ch)
			e.assertAgree(b, 1)
			stateBefore, outboxBefore := e.visibilityRows(b)
			if outboxBefore == "" {
				t.Fatal("setup: the hide left no outbox row")
			}

			m := a.Event(t, 9, nostr.Tags{{"h", ch}}, "are you there?")
			// A non-retryable error (db.Retry retries only 40001 and 40P01). Its message tells
			// what the failing transaction had done to b by then.
			if _, err := e.pool.Exec(ctx, `
				CREATE FUNCTION public.test_fail_event() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN
				  RAISE EXCEPTION 'event insert failed (test); b hidden: %, b target: %',
				    (SELECT hidden_at IS NOT NULL FROM buzz.members WHERE channel_id = '`+ch+`' AND pubkey = '`+b.PK+`'),
				    (SELECT target_generation FROM buzz.visibility_state WHERE viewer = '`+b.PK+`')
				    USING ERRCODE = 'XX000';
				END $$;`); err != nil {
				t.Fatal(err)
			}
			if _, err := e.pool.Exec(ctx, tc.trigger(m.ID)); err != nil {
				t.Fatal(err)
			}
			cleanup := func() {
				_, _ = e.pool.Exec(ctx, `DROP TRIGGER IF EXISTS test_fail_event ON buzz.events;
					DROP FUNCTION IF EXISTS public.test_fail_event()`)
			}
			t.Cleanup(cleanup)

			// LISTEN first: a notification committed from here on reaches this session.
			l := e.session("i1-listen")
			if _, err := l.Conn.Exec(ctx, `LISTEN buzz_visibility; LISTEN i1_test_barrier`); err != nil {
				t.Fatal(err)
			}

			ok, msg, err := store.Accept(ctx, e.pool, m)
			if err == nil || ok || !strings.Contains(err.Error(), "event insert failed (test)") {
				t.Fatalf("accept must fail when the event insert fails: ok=%v msg=%q err=%v", ok, msg, err)
			}
			if n := e.storedCount(m.ID); n != 0 {
				t.Fatalf("the message was stored %d times although its insert failed", n)
			}
			if !e.hidden(b, ch) {
				t.Fatal("I1 broken: the hide was cleared although the message was not stored")
			}
			if state, outbox := e.visibilityRows(b); state != stateBefore || outbox != outboxBefore {
				t.Fatalf("I1 broken: the visibility state or outbox changed although the message was not stored:\n"+
					"state  before %s\n       after  %s\noutbox before %s\n       after  %s", stateBefore, state, outboxBefore, outbox)
			}
			e.assertAgree(b, 1)
			// No notification: a barrier NOTIFY (on a channel of its own, which wakes no
			// listener) committed now is delivered after anything the failed acceptance
			// committed (notifications arrive in commit order), so it must be the first one
			// this session receives.
			if _, err := e.pool.Exec(ctx, `SELECT pg_notify('i1_test_barrier', 'barrier')`); err != nil {
				t.Fatal(err)
			}
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			n, nerr := l.Conn.WaitForNotification(wctx)
			if nerr != nil {
				t.Fatalf("waiting for the barrier notification: %v", nerr)
			}
			if n.Payload != "barrier" {
				t.Fatalf("I1 broken: a notification (%q on %s) was committed by the failed acceptance", n.Payload, n.Channel)
			}

			// The case is the one it claims to be: what the failing transaction had done to b.
			if !strings.Contains(err.Error(), "b hidden: "+tc.inFlight) {
				t.Fatalf("inside the failing transaction b's state was not %q: %v", tc.inFlight, err)
			}

			// Once the insert works, the same event is accepted and resurfaces the DM.
			cleanup()
			if ok, msg := e.accept(m); !ok || msg != "" {
				t.Fatalf("resend: %v %q", ok, msg)
			}
			if n := e.storedCount(m.ID); n != 1 || e.hidden(b, ch) {
				t.Fatalf("after resend: stored %d, hidden %v", n, e.hidden(b, ch))
			}
			e.assertAgree(b, 2)
		})
	}
}

// I1 in a batch (buzz.accept_events, sql/0002_accept.up.sql, what the relay calls when events arrive together):
// each event is a subtransaction, so an event whose visibility consequence fails is rolled back
// whole, the recipient's hide and generation included, while the other event of the call commits
// with its own consequence.
func TestAcceptEventsRollsBackAnEventWithItsConsequence(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, b, c, d := newUser(), newUser(), newUser(), newUser()
	ch1, ch2 := e.open(a, b), e.open(c, d)
	e.hide(b, ch1)
	e.hide(d, ch2)
	e.assertAgree(b, 1)
	e.assertAgree(d, 1)

	// b's outbox write fails with a client SQLSTATE, which accept_events answers per event.
	fn := "test_fail_outbox_" + b.PK[:12]
	_, err := e.pool.Exec(ctx, `
		CREATE FUNCTION public.`+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION USING ERRCODE = 'BZ400', MESSAGE = 'invalid: outbox write failed (test)'; END $$;
		CREATE TRIGGER `+fn+` BEFORE INSERT OR UPDATE ON buzz.visibility_outbox
		  FOR EACH ROW WHEN (NEW.viewer = '`+b.PK+`') EXECUTE FUNCTION public.`+fn+`();`)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = e.pool.Exec(ctx, `DROP TRIGGER IF EXISTS `+fn+` ON buzz.visibility_outbox; DROP FUNCTION IF EXISTS public.`+fn+`()`)
	})

	m1, m2 := a.Event(t, 9, nostr.Tags{{"h", ch1}}, "to b"), c.Event(t, 9, nostr.Tags{{"h", ch2}}, "to d")
	raw, _ := json.Marshal([]*nostr.Event{m1, m2})
	rows, err := e.pool.Query(ctx, `SELECT ok, message, coalesce(code, '') FROM buzz.accept_events($1::jsonb)`, string(raw))
	if err != nil {
		t.Fatalf("the call failed as a whole: %v", err)
	}
	var got []string
	for rows.Next() {
		var ok bool
		var msg, code string
		if err := rows.Scan(&ok, &msg, &code); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%v %q %s", ok, msg, code))
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	want := []string{`false "invalid: outbox write failed (test)" BZ400`, `true "" `}
	if !slices.Equal(got, want) {
		t.Fatalf("rows %q, want %q", got, want)
	}
	if e.storedCount(m1.ID) != 0 || !e.hidden(b, ch1) {
		t.Fatal("I1 broken: the failed event's message or its resurfacing survived in the batch")
	}
	e.assertAgree(b, 1)
	if e.storedCount(m2.ID) != 1 || e.hidden(d, ch2) {
		t.Fatal("the other event of the call lost its message or its resurfacing")
	}
	e.assertAgree(d, 2)
}
