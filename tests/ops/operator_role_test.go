package ops

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// asRole runs q as role (SET LOCAL ROLE on an admin connection) and rolls back unless commit.
func asRole(t *testing.T, admin *pgxpool.Pool, role string, commit bool, q string, args ...any) error {
	t.Helper()
	ctx := context.Background()
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SET LOCAL ROLE `+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, q, args...)
	if err == nil {
		for rows.Next() {
		}
		rows.Close()
		err = rows.Err()
	}
	if err == nil && commit {
		err = tx.Commit(ctx)
	}
	return err
}

// openDM opens a DM between a and b as the owner and returns its channel id.
func openDM(t *testing.T, dbURL string, a, b testenv.User) string {
	t.Helper()
	s := testenv.NewSession(t, dbURL, "setup")
	s.Begin()
	ok, msg, err := s.Accept(a.Event(t, 41010, nostr.Tags{{"p", b.PK}}, ""))
	s.Commit()
	var resp struct {
		ChannelID string `json:"channel_id"`
	}
	if err != nil || !ok || json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp) != nil || resp.ChannelID == "" {
		t.Fatalf("DM open: %v %q %v", ok, msg, err)
	}
	return resp.ChannelID
}

// buzz_operator reads everything and calls the operator functions, and nothing else: not the
// functions that trust a signature check (an unsigned message or snapshot would be served), not
// DML on generations, members, config or events (a generation at the bigint maximum, an outsider
// made member, another key made the relay's), and not pg_logical_emit_message.
func TestOperatorRoleOnlyReadsAndOperates(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	admin := testenv.Pool(t, dbURL)
	ctx := context.Background()
	a, b, mallory := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()
	ch := openDM(t, dbURL, a, b)
	unsigned := a.Event(t, 9, nostr.Tags{{"h", ch}}, "not signed by a")
	unsigned.Sig = strings.Repeat("0", 128)
	rawMsg, _ := json.Marshal(unsigned)
	snap, _ := json.Marshal(map[string]any{"id": strings.Repeat("1", 64), "pubkey": mallory.PK, "created_at": 1,
		"kind": 30622, "tags": [][]string{{"d", b.PK}, {"p", b.PK}}, "content": "", "sig": strings.Repeat("0", 128)})

	denied := []struct {
		q    string
		args []any
	}{
		{`SELECT * FROM buzz.accept_event($1::jsonb)`, []any{string(rawMsg)}},
		{`SELECT * FROM buzz.accept_events($1::jsonb)`, []any{"[" + string(rawMsg) + "]"}},
		{`SELECT buzz.publish_visibility_snapshot($1, 9, $2::jsonb)`, []any{b.PK, string(snap)}},
		{`SELECT * FROM buzz.publish_visibility_snapshots(ARRAY[$1], ARRAY[9::bigint], ARRAY[$2::jsonb])`, []any{b.PK, string(snap)}},
		{`SELECT * FROM buzz.claim_visibility_work(gen_random_uuid(), 10, '30 seconds')`, nil},
		{`SELECT buzz.release_visibility_claims(ARRAY[gen_random_uuid()])`, nil},
		{`SELECT buzz.sweep_visibility()`, nil},
		{`SELECT * FROM buzz.claim_due_reminders(10, '30 seconds')`, nil},
		{`SELECT * FROM buzz.confirm_reminder_claims('{}', '{}')`, nil},
		{`SELECT * FROM buzz.rollback_reminder_claims('{}', '{}')`, nil},
		{`SELECT buzz.set_dm_hidden($1, $2::uuid, true)`, []any{b.PK, ch}},
		{`SELECT buzz.open_dm($1, ARRAY[$2], '')`, []any{a.PK, mallory.PK}},
		{`SELECT buzz.retire_generation($1, 1)`, []any{b.PK}},
		{`SELECT pg_logical_emit_message(true, 'buzz', '{"t":"members","all":true}')`, nil},
		{`UPDATE buzz.visibility_state SET target_generation = 9223372036854775807, published_generation = 9223372036854775807`, nil},
		{`DELETE FROM buzz.visibility_state`, nil},
		{`UPDATE buzz.visibility_outbox SET available_at = now()`, nil},
		{`INSERT INTO buzz.members (channel_id, pubkey) VALUES ($1::uuid, $2)`, []any{ch, mallory.PK}},
		{`UPDATE buzz.members SET hidden_at = now()`, nil},
		{`UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, []any{mallory.PK}},
		{`DELETE FROM buzz.events`, nil},
		{`INSERT INTO buzz.visibility_retired (viewer, generation) VALUES ($1, 1)`, []any{mallory.PK}},
		{`SELECT nextval('buzz.reminder_stamp_seq')`, nil},
	}
	for _, d := range denied {
		if err := asRole(t, admin, "buzz_operator", false, d.q, d.args...); db.SQLState(err) != "42501" {
			t.Errorf("as buzz_operator: %s: err %v (SQLSTATE %q), want 42501 permission denied", d.q, err, db.SQLState(err))
		}
	}

	// What an operator may do: read, and the operator functions.
	works := []string{
		`SELECT count(*) FROM buzz.events`, `SELECT count(*) FROM buzz.members`, `SELECT count(*) FROM buzz.channels`,
		`SELECT count(*) FROM buzz.config`, `SELECT count(*) FROM buzz.visibility_state`,
		`SELECT count(*) FROM buzz.visibility_outbox`, `SELECT count(*) FROM buzz.visibility_retired`,
		`SELECT count(*) FROM buzz.reminders`, `SELECT count(*) FROM buzz.instances`, `SELECT count(*) FROM buzz.deleted_ids`,
		`SELECT count(*) FROM buzz.event_tags`,
		`SELECT * FROM buzz.visibility_lag()`, `SELECT * FROM buzz.visibility_lag_detail()`,
		`SELECT * FROM buzz.reminder_status()`, `SELECT * FROM buzz.fanout_status()`, `SELECT * FROM buzz.next_reminder_wakeup()`,
		`SELECT * FROM buzz.visibility_source('` + b.PK + `')`, `SELECT buzz.cfg('relay_pubkey')`,
	}
	for _, q := range works {
		if err := asRole(t, admin, "buzz_operator", false, q); err != nil {
			t.Errorf("as buzz_operator: %s: %v", q, err)
		}
	}
	opCall := func(q string, args ...any) {
		t.Helper()
		if err := asRole(t, admin, "buzz_operator", true, q, args...); err != nil {
			t.Fatalf("as buzz_operator: %s: %v", q, err)
		}
	}
	// Hide: the viewer's generation is bumped and its outbox row queued (no publisher runs here).
	opCall(`SELECT buzz.hide_dm($1, $2::uuid)`, b.PK, ch)
	if n := testenv.MustInt(t, admin, `SELECT count(*) FROM buzz.members WHERE pubkey = $1 AND hidden_at IS NOT NULL`, b.PK); n != 1 {
		t.Fatalf("hide_dm as operator: %d hidden member rows", n)
	}
	// Retry: a row in backoff is due again.
	if _, err := admin.Exec(ctx, `UPDATE buzz.visibility_outbox SET available_at = now() + interval '1 hour', attempts = 3 WHERE viewer = $1`, b.PK); err != nil {
		t.Fatal(err)
	}
	opCall(`SELECT buzz.retry_visibility($1)`, b.PK)
	if n := testenv.MustInt(t, admin, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1 AND available_at <= now() AND attempts = 3`, b.PK); n != 1 {
		t.Fatalf("retry_visibility as operator: %d rows of the viewer due with their attempts", n)
	}
	// Reset: the state row goes and its generations are retired (the unpublished hide stays
	// pending in a new row above them).
	opCall(`SELECT buzz.reset_visibility($1)`, b.PK)
	if n := testenv.MustInt(t, admin, `SELECT count(*) FROM buzz.visibility_retired WHERE viewer = $1`, b.PK); n != 1 {
		t.Fatalf("reset_visibility as operator: no retired generation")
	}
	opCall(`SELECT buzz.unhide_dm($1, $2::uuid)`, b.PK, ch)
	for _, q := range []string{`SELECT buzz.reset_visibility('x')`, `SELECT buzz.reset_visibility(NULL)`, `SELECT buzz.retry_visibility('x')`} {
		if err := asRole(t, admin, "buzz_operator", false, q); db.SQLState(err) != "BZ400" {
			t.Errorf("as buzz_operator: %s: err %v, want BZ400 invalid:", q, err)
		}
	}

	// The relay role writes through its functions, and by hand only its settings and instances.
	for _, q := range []string{
		`UPDATE buzz.visibility_state SET published_generation = target_generation`,
		`INSERT INTO buzz.members (channel_id, pubkey) VALUES ('` + ch + `', '` + mallory.PK + `')`,
		`DELETE FROM buzz.events`,
		`UPDATE buzz.reminders SET state = 'armed'`,
		`SELECT buzz.hide_dm('` + b.PK + `', '` + ch + `'::uuid)`,
	} {
		if err := asRole(t, admin, "buzz_relay", false, q); db.SQLState(err) != "42501" {
			t.Errorf("as buzz_relay: %s: err %v (SQLSTATE %q), want 42501 permission denied", q, err, db.SQLState(err))
		}
	}
}
