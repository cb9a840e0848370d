package tests

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A claim made from psql with a NULL lease would never be recovered (recovery waits for
// lease_until < now()): the claim functions refuse it with BZ400, a hand-written UPDATE
// that makes one is refused by the tables' constraints with 23514, and the row stays claimable.
func TestClaimsWithoutALeaseAreRefused(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	wantRefused := func(what, code string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != code {
			t.Fatalf("%s with a NULL lease: %v, want SQLSTATE %s", what, err, code)
		}
	}

	due := remDue(t, pool)
	_, err := pool.Exec(ctx, `SELECT * FROM buzz.claim_due_reminders(10, NULL)`)
	wantRefused("claim_due_reminders", "BZ400", err)
	_, err = pool.Exec(ctx, `UPDATE buzz.reminders SET state = 'claimed', stamp = 1, lease_until = NULL WHERE id = $1`, due.ID)
	wantRefused("a hand-written reminder claim", "23514", err)
	if r := remGet(t, pool, due.ID); r.State != "armed" {
		t.Fatalf("reminder after the refused claim: %+v, want armed", r)
	}
	if s := remClaim(t, pool, due); s == nil {
		t.Fatal("the reminder is not claimable after the refused claim")
	}

	_, viewer := testenv.NewKey()
	_, other := testenv.NewKey()
	if _, err := pool.Exec(ctx, `SELECT buzz.hide_dm($1, (buzz.open_dm($1, ARRAY[$2], NULL)).channel_id)`, viewer, other); err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(ctx, `SELECT * FROM buzz.claim_visibility_work(gen_random_uuid(), 10, NULL)`)
	wantRefused("claim_visibility_work", "BZ400", err)
	_, err = pool.Exec(ctx, `UPDATE buzz.visibility_outbox SET claim_id = gen_random_uuid(), lease_until = NULL WHERE viewer = $1`, viewer)
	wantRefused("a hand-written outbox claim", "23514", err)
	var claimed []string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(viewer), '{}') FROM buzz.claim_visibility_work(gen_random_uuid(), 10, '1 minute')`).Scan(&claimed); err != nil {
		t.Fatal(err)
	}
	if len(claimed) != 1 || claimed[0] != viewer {
		t.Fatalf("claimed %v after the refused claim, want the viewer %s", claimed, viewer)
	}
}
