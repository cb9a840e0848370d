package store_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// accept_event trusts its caller to have verified the signature, so EXECUTE is granted to the
// relay role only (sql/0006_roles.up.sql): any other role, the operator's included, even
// one that may use schema buzz, gets permission denied (42501) on the function itself.
func TestAcceptEventExecuteOnlyForRelay(t *testing.T) {
	url := testenv.FreshDB(t)
	ctx := context.Background()
	admin := testenv.NewSession(t, url, "grants")
	role := "buzz_test_nogrant_" + testenv.NewUser().PK[:12] // cluster-wide: random, not a reusable PID
	if _, err := admin.Conn.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Roles are cluster-wide: drop this one (its grant in this database first).
		c, err := pgx.Connect(context.Background(), url)
		if err != nil {
			t.Logf("drop role %s: %v", role, err)
			return
		}
		defer c.Close(context.Background())
		_, _ = c.Exec(context.Background(), `DROP OWNED BY `+pgx.Identifier{role}.Sanitize())
		if _, err := c.Exec(context.Background(), `DROP ROLE `+pgx.Identifier{role}.Sanitize()); err != nil {
			t.Logf("drop role %s: %v", role, err)
		}
	})
	// The schema is usable, so the only thing missing is EXECUTE on the function.
	if _, err := admin.Conn.Exec(ctx, `GRANT USAGE ON SCHEMA buzz TO `+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	u := testenv.NewUser()
	raw, _ := u.Event(t, 1, nostr.Tags{}, "grants").MarshalJSON()

	// accept_events (0028) takes the same trust and gets the same grants.
	for _, fn := range []struct{ name, signature, call, arg string }{
		{"accept_event", "buzz.accept_event(jsonb)", `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)},
		{"accept_events", "buzz.accept_events(jsonb,integer)", `SELECT ok, message FROM buzz.accept_events($1::jsonb)`, "[" + string(raw) + "]"},
	} {
		call := func(as string) error {
			t.Helper()
			tx, err := admin.Conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, `SET LOCAL ROLE `+pgx.Identifier{as}.Sanitize()); err != nil {
				t.Fatal(err)
			}
			var ok bool
			var msg string
			return tx.QueryRow(ctx, fn.call, fn.arg).Scan(&ok, &msg)
		}
		deniedOnFunction := func(err error) bool {
			return db.SQLState(err) == "42501" && strings.Contains(err.Error(), "function "+fn.name)
		}

		err := call(role)
		if !deniedOnFunction(err) {
			t.Fatalf("role %s without grants calling buzz.%s: err %v (SQLSTATE %q), want 42501 permission denied for function %s",
				role, fn.name, err, db.SQLState(err), fn.name)
		}
		// PUBLIC has nothing either: the privilege list names the relay role (and the owner) only.
		var acl string
		if err := admin.Conn.QueryRow(ctx, `SELECT coalesce(proacl::text, '') FROM pg_proc
			WHERE oid = $1::regprocedure`, fn.signature).Scan(&acl); err != nil {
			t.Fatal(err)
		}
		if acl == "" || strings.Contains(acl, "{=X") || strings.Contains(acl, ",=X") {
			t.Fatalf("buzz.%s privileges %q: PUBLIC may execute it", fn.name, acl)
		}
		// The relay role gets past the function's EXECUTE check; the operator role does not.
		if err := call("buzz_relay"); deniedOnFunction(err) {
			t.Fatalf("buzz_relay calling buzz.%s: %v, want EXECUTE granted", fn.name, err)
		}
		if err := call("buzz_operator"); !deniedOnFunction(err) {
			t.Fatalf("buzz_operator calling buzz.%s: err %v (SQLSTATE %q), want 42501 permission denied for function %s",
				fn.name, err, db.SQLState(err), fn.name)
		}
	}
}
