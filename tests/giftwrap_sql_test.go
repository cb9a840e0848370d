package tests

// A gift wrap (1059) is served to the one pubkey its p tag names (docs/protocol.md, Read gates). The
// relay refuses a wrap naming two different keys before it calls accept_event; before 0024 an
// operator's `SELECT buzz.accept_event(...)` stored one, readable by its first recipient only.
// accept_event now gives the relay's answer for every p-tag shape, from psql as over the wire.

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

func TestGiftWrapRecipientsFromSQLAsFromTheRelay(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t)) // no relay on it: its heartbeats would move the digest
	r := testenv.StartRelay(t, testenv.RelayOpts{})
	c := rbDial(t, r.URL)
	ctx := context.Background()
	sender, x, y := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()

	const oneRecipient = "invalid: a gift wrap names one recipient (p tag); send one wrap per recipient"
	cases := []struct {
		name string
		tags nostr.Tags
		want string // the refusal; "" = accepted, gated on x
	}{
		{"two recipients", nostr.Tags{{"p", x.PK}, {"p", y.PK}}, oneRecipient},
		{"a second recipient that is no key", nostr.Tags{{"p", x.PK}, {"p", "someone"}}, oneRecipient},
		{"no p tag", nostr.Tags{{"e", x.PK}}, "invalid: gift wrap needs a p tag"},
		{"one recipient twice, once with a relay hint", nostr.Tags{{"p", x.PK}, {"p", x.PK, "wss://relay.example"}}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// The relay and psql see the same event, each in its own database.
			ev := sender.Event(t, 1059, tc.tags, "sealed")
			raw, _ := json.Marshal(ev)

			before := opinState(t, pool)
			var ok bool
			var msg string
			err := pool.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg)
			relay := c.Publish(ev)

			if tc.want != "" {
				var pgErr *pgconn.PgError
				if !errors.As(err, &pgErr) || pgErr.Code != "BZ400" || pgErr.Message != tc.want {
					t.Errorf("from SQL: ok=%v %q err %v; want SQLSTATE BZ400 %q", ok, msg, err, tc.want)
				}
				if relay.OK || relay.Msg != tc.want {
					t.Errorf("from the relay: %+v; want OK false %q", relay, tc.want)
				}
				opinAssertUnchanged(t, before, opinState(t, pool))
				return
			}
			if err != nil || !ok || msg != "" {
				t.Fatalf("from SQL: ok=%v %q err %v; want accepted", ok, msg, err)
			}
			if !relay.OK {
				t.Errorf("from the relay: %+v; want accepted", relay)
			}
			if gate := testenv.MustScalar[string](t, pool, `SELECT scope::text || ':' || scope_p FROM buzz.events WHERE id = $1`, ev.ID); gate != "p:"+x.PK {
				t.Fatalf("stored with gate %q, want p:%s", gate, x.PK)
			}
		})
	}
}

// The case 0027's refusal is for: a member of a DM wraps an event naming that DM for someone who
// is not a member. Before 0027 it was stored with the recipient's gate ('p'), so a non-member read
// an event naming the channel while its members could not. The guard is a trigger on the table,
// so a hand-written INSERT is refused too. (A wrap naming a channel the sender is not in is
// refused earlier by accept_event's channel checks, 'restricted:'; the relay refuses every wrap
// with an h tag before calling it: relay/giftwrap_test.go.)
func TestGiftWrapNamingItsSendersDMIsRefused(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	sender, outsider, member := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()
	var ch string
	if err := pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, sender.PK, member.PK).Scan(&ch); err != nil {
		t.Fatal(err)
	}
	ev := sender.Event(t, 1059, nostr.Tags{{"p", outsider.PK}, {"h", ch}}, "sealed")
	raw, _ := json.Marshal(ev)
	before := opinState(t, pool)
	_, err := pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(raw))
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "BZ400" || !strings.HasPrefix(pgErr.Message, "invalid: a gift wrap names no channel") {
		t.Fatalf("a wrap naming the sender's DM, for an outsider: err %v; want BZ400 invalid: a gift wrap names no channel", err)
	}
	opinAssertUnchanged(t, before, opinState(t, pool))

	_, err = pool.Exec(ctx, `INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, h, scope, scope_p, channel_id)
		VALUES ($1, $2, $3, 1059, $4::jsonb, 'sealed', $5, $6::text, 'p', $7, $6::text::uuid)`,
		ev.ID, ev.PubKey, int64(ev.CreatedAt), mustJSON(t, ev.Tags), ev.Sig, ch, outsider.PK)
	if !errors.As(err, &pgErr) || pgErr.Code != "BZ400" {
		t.Fatalf("a hand-written INSERT of the wrap: err %v; want BZ400", err)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
