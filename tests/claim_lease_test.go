package tests

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A claim made from psql with a NULL lease would never be recovered (recovery waits for
// lease_until < now()): it is refused with 23514, and the row stays claimable.
func TestClaimsWithoutALeaseAreRefused(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	wantCheckViolation := func(what string, err error) {
		t.Helper()
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" {
			t.Fatalf("%s with a NULL lease: %v, want a check violation (23514)", what, err)
		}
	}

	due := remDue(t, pool)
	_, err := pool.Exec(ctx, `SELECT * FROM buzz.claim_due_reminders(10, NULL)`)
	wantCheckViolation("claim_due_reminders", err)
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
	wantCheckViolation("claim_visibility_work", err)
	var claimed []string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(viewer), '{}') FROM buzz.claim_visibility_work(gen_random_uuid(), 10, '1 minute')`).Scan(&claimed); err != nil {
		t.Fatal(err)
	}
	if len(claimed) != 1 || claimed[0] != viewer {
		t.Fatalf("claimed %v after the refused claim, want the viewer %s", claimed, viewer)
	}
}
