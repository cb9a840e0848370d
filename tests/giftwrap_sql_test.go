package tests

// A gift wrap (1059) is served to the one pubkey its p tag names (PROTOCOL.md, read gates). The
// relay refuses a wrap naming two different keys before it calls accept_event; before 0024 an
// operator's `SELECT buzz.accept_event(...)` stored one, readable by its first recipient only.
// accept_event now gives the relay's answer for every p-tag shape, from psql as over the wire.

import (
	"context"
	"encoding/json"
	"errors"
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
