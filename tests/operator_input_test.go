package tests

// Operators call the SQL API from psql (README, "The SQL API"), with arguments the relay never
// passes: NULLs, malformed keys, misaligned arrays. Each one is refused with SQLSTATE BZ400 and an
// `invalid:` message, the project's standard for bad input, before the function changes anything
// (the checks at the top of each function in sql/). Without them these fail with raw PostgreSQL
// errors (23502, 22023, 2201W, 23514, P0001), answer as if the input were fine ('retry', zeros),
// or change state (a NULL hide re-opens the DM, a NULL claim id leases rows to nobody, ...).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/visibility"
)

// opinFixture is what the bad calls aim at: rows each one would change without its checks.
type opinFixture struct {
	relaySK string
	v, ch   string // v has DM ch hidden: pending at generation 1
	evV     string // v's well-formed snapshot at generation 1
	v1, v2  string // for the batch: v1 pending at generation 2, ev1 read at its generation 1
	ev1     string
	ev2     string // v2's snapshot at its generation 1
	r       string // an outbox row claimed under claim, lease live
	claim   string
	due     *nostr.Event // an armed, due reminder
	stuck   *nostr.Event // a claimed reminder whose lease is over
	slot    string       // an inactive buzz_ slot without an instance row
}

// opinSnapshot reads viewer's source and returns its snapshot signed by the relay key, as JSON.
func opinSnapshot(t testing.TB, pool *pgxpool.Pool, sk, viewer string) (generation int64, body string) {
	t.Helper()
	var hidden []string
	var floor, now int64
	if err := pool.QueryRow(context.Background(), `SELECT generation, hidden::text[], created_at_floor, buzz.now_unix()
		FROM buzz.visibility_source($1)`, viewer).Scan(&generation, &hidden, &floor, &now); err != nil {
		t.Fatal(err)
	}
	ev := visibility.BuildSnapshot(viewer, hidden, max(now, floor+1))
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(ev)
	return generation, string(raw)
}

// opinEdit returns the JSON event body with edit applied to its fields.
func opinEdit(t testing.TB, body string, edit func(map[string]any)) string {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(body), &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	raw, _ := json.Marshal(m)
	return string(raw)
}

func opinSetup(t *testing.T, pool *pgxpool.Pool) opinFixture {
	t.Helper()
	ctx := context.Background()
	var f opinFixture
	var relayPK string
	f.relaySK, relayPK = testenv.NewKey()
	snapExec(t, pool, `UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, relayPK)
	hide := func(viewer, ch string) { snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, ch) }

	f.v, f.ch = snapSQLDM(t, pool)
	hide(f.v, f.ch)
	_, f.evV = opinSnapshot(t, pool, f.relaySK, f.v)

	var a, b string
	f.v1, a = snapSQLDM(t, pool)
	_, other := testenv.NewKey()
	if err := pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, f.v1, other).Scan(&b); err != nil {
		t.Fatal(err)
	}
	hide(f.v1, a)
	_, f.ev1 = opinSnapshot(t, pool, f.relaySK, f.v1) // hidden {a}, generation 1
	hide(f.v1, b)                                     // generation 2: hidden {a, b}
	var ch2 string
	f.v2, ch2 = snapSQLDM(t, pool)
	hide(f.v2, ch2)
	_, f.ev2 = opinSnapshot(t, pool, f.relaySK, f.v2)

	var chR string
	f.r, chR = snapSQLDM(t, pool)
	hide(f.r, chR)
	if err := pool.QueryRow(ctx, `UPDATE buzz.visibility_outbox SET claim_id = gen_random_uuid(), lease_until = now() + interval '1 hour'
		WHERE viewer = $1 RETURNING claim_id::text`, f.r).Scan(&f.claim); err != nil {
		t.Fatal(err)
	}

	f.due = remDue(t, pool)
	f.stuck = remDue(t, pool)
	var stamp *int64
	if err := pool.QueryRow(ctx, `SELECT buzz.claim_due_reminder($1, $2, interval '-1 minute')`,
		f.stuck.ID, int64(f.stuck.CreatedAt)).Scan(&stamp); err != nil || stamp == nil {
		t.Fatalf("claim the reminder with a lease already over: stamp %v, %v", stamp, err)
	}

	f.slot = fmt.Sprintf("buzz_opin_%d", time.Now().UnixNano()%1e12)
	snapExec(t, pool, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, f.slot)
	snapExec(t, pool, `SELECT buzz.instance_heartbeat('opin-live', 'buzz_opin_live_no_slot')`)
	return f
}

// opinState is every row of every table in schema buzz (a count and a digest per table) and the
// database's replication slots.
func opinState(t testing.TB, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, `SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = 'buzz' AND c.relkind = 'r' ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var tables []string
	for rows.Next() {
		var name string
		_ = rows.Scan(&name)
		tables = append(tables, name)
	}
	rows.Close()
	if len(tables) < 8 {
		t.Fatalf("found %d tables in schema buzz", len(tables))
	}
	state := map[string]string{}
	for _, name := range tables {
		var n int64
		var digest string
		if err := pool.QueryRow(ctx, `SELECT count(*), md5(coalesce(string_agg(t::text, E'\n' ORDER BY t::text), ''))
			FROM buzz.`+name+` t`).Scan(&n, &digest); err != nil {
			t.Fatal(err)
		}
		state[name] = fmt.Sprintf("%d rows %s", n, digest)
	}
	var slots string
	if err := pool.QueryRow(ctx, `SELECT coalesce(string_agg(slot_name || ':' || active, ',' ORDER BY slot_name), '')
		FROM pg_replication_slots WHERE database = current_database()`).Scan(&slots); err != nil {
		t.Fatal(err)
	}
	state["replication slots"] = slots
	return state
}

func opinAssertUnchanged(t testing.TB, before, after map[string]string) {
	t.Helper()
	for name, b := range before {
		if a := after[name]; a != b {
			t.Errorf("%s changed: before %s, after %s", name, b, a)
		}
	}
}

// opinAssertRefused runs sql and checks that it is refused with BZ400, an `invalid:` message
// containing want, and that no buzz table (nor a slot) changed.
func opinAssertRefused(t testing.TB, pool *pgxpool.Pool, want, sql string, args ...any) {
	t.Helper()
	before := opinState(t, pool)
	_, err := pool.Exec(context.Background(), sql, args...)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		t.Errorf("err %v, want SQLSTATE BZ400 %q", err, want)
	} else if pgErr.Code != "BZ400" || !strings.HasPrefix(pgErr.Message, "invalid: ") || !strings.Contains(pgErr.Message, want) {
		t.Errorf("SQLSTATE %s %q, want BZ400 %q", pgErr.Code, pgErr.Message, want)
	}
	opinAssertUnchanged(t, before, opinState(t, pool))
}

func TestOperatorInputRefusedWithoutChange(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	ctx := context.Background()
	f := opinSetup(t, pool)
	upper := strings.ToUpper

	noSig := opinEdit(t, f.evV, func(m map[string]any) { delete(m, "sig") })
	scalarTag := opinEdit(t, f.evV, func(m map[string]any) { m["tags"] = append(m["tags"].([]any), "x") })
	objectTag := opinEdit(t, f.evV, func(m map[string]any) { m["tags"] = append(m["tags"].([]any), map[string]any{"h": f.ch}) })

	cases := []struct {
		name string
		sql  string
		args []any
		want string
	}{
		// publish_visibility_snapshot(s)
		{"publish: no sig", `SELECT buzz.publish_visibility_snapshot($1, 1, $2::jsonb)`, []any{f.v, noSig}, "invalid: malformed snapshot"},
		{"publish: NULL generation", `SELECT buzz.publish_visibility_snapshot($1, NULL, $2::jsonb)`, []any{f.v, f.evV}, "invalid: generation is NULL"},
		{"publish: a tag that is a string", `SELECT buzz.publish_visibility_snapshot($1, 1, $2::jsonb)`, []any{f.v, scalarTag}, "invalid: snapshot tags are arrays of two or more strings"},
		{"publish: a tag that is an object", `SELECT buzz.publish_visibility_snapshot($1, 1, $2::jsonb)`, []any{f.v, objectTag}, "invalid: snapshot tags are arrays of two or more strings"},
		// Generations indexed from 0: v1's snapshot of generation 1 would be recorded as generation 2.
		{"batch: generations indexed from 0", `SELECT * FROM buzz.publish_visibility_snapshots($1, $2::text::bigint[], $3::jsonb[])`,
			[]any{[]string{f.v1, f.v2}, "[0:1]={1,2}", []string{f.ev1, f.ev2}}, "invalid: viewers, generations and events must be one-dimensional arrays indexed from 1"},
		{"batch: a NULL generation", `SELECT * FROM buzz.publish_visibility_snapshots($1, ARRAY[NULL]::bigint[], $2::jsonb[])`,
			[]any{[]string{f.v2}, []string{f.ev2}}, "invalid: generation is NULL"},

		// visibility_source
		{"source: NULL viewer", `SELECT * FROM buzz.visibility_source(NULL)`, nil, "invalid: viewer must be 64 lowercase hex characters"},
		{"source: upper-case viewer", `SELECT * FROM buzz.visibility_source($1)`, []any{upper(f.v)}, "invalid: viewer must be 64 lowercase hex characters"},

		// set_dm_hidden, hide_dm, unhide_dm
		{"set_dm_hidden: NULL hide", `SELECT buzz.set_dm_hidden($1, $2::uuid, NULL)`, []any{f.v, f.ch}, "invalid: hide must be true or false"},
		{"hide_dm: NULL viewer", `SELECT buzz.hide_dm(NULL, $1::uuid)`, []any{f.ch}, "invalid: viewer must be 64 lowercase hex characters"},
		{"unhide_dm: upper-case viewer", `SELECT buzz.unhide_dm($1, $2::uuid)`, []any{upper(f.v), f.ch}, "invalid: viewer must be 64 lowercase hex characters"},
		{"unhide_dm: NULL channel", `SELECT buzz.unhide_dm($1, NULL)`, []any{f.v}, "invalid: channel is NULL"},

		// claim_visibility_work, release_visibility_claim
		{"claim work: NULL claim id", `SELECT * FROM buzz.claim_visibility_work(NULL, 10, '1 minute')`, nil, "invalid: p_claim is NULL"},
		{"claim work: NULL max", `SELECT * FROM buzz.claim_visibility_work(gen_random_uuid(), NULL, '1 minute')`, nil, "invalid: p_max must be 0 or more"},
		{"claim work: negative max", `SELECT * FROM buzz.claim_visibility_work(gen_random_uuid(), -1, '1 minute')`, nil, "invalid: p_max must be 0 or more"},
		{"claim work: NULL lease", `SELECT * FROM buzz.claim_visibility_work(gen_random_uuid(), 10, NULL)`, nil, "invalid: p_lease is NULL"},
		{"release: NULL cap", `SELECT buzz.release_visibility_claim($1, $2::uuid, 'boom', '1 second', NULL)`, []any{f.r, f.claim}, "invalid: p_base and p_cap must not be NULL"},
		{"release: NULL base and cap", `SELECT buzz.release_visibility_claim($1, $2::uuid, 'boom', NULL, NULL)`, []any{f.r, f.claim}, "invalid: p_base and p_cap must not be NULL"},

		// reminder batches
		{"claim reminders: NULL max", `SELECT * FROM buzz.claim_due_reminders(NULL, '1 minute')`, nil, "invalid: p_max must be 0 or more"},
		{"claim reminders: negative max", `SELECT * FROM buzz.claim_due_reminders(-1, '1 minute')`, nil, "invalid: p_max must be 0 or more"},
		{"claim reminders: NULL lease", `SELECT * FROM buzz.claim_due_reminders(10, NULL)`, nil, "invalid: p_lease is NULL"},
		{"claim reminders: NULL p_with_event", `SELECT * FROM buzz.claim_due_reminders(10, '1 minute', NULL)`, nil, "invalid: p_with_event must be true or false"},
		{"rollback reminders: fewer stamps than ids", `SELECT * FROM buzz.rollback_reminder_claims(ARRAY[$1], '{}')`, []any{f.stuck.ID}, "invalid: rollback_reminder_claims: 1 ids but 0 stamps"},
		{"confirm reminders: fewer stamps than ids", `SELECT * FROM buzz.confirm_reminder_claims(ARRAY[$1], '{}')`, []any{f.stuck.ID}, "invalid: confirm_reminder_claims: 1 ids but 0 stamps"},

		// retire_generation
		{"retire: NULL viewer", `SELECT buzz.retire_generation(NULL, 7)`, nil, "invalid: p_viewer must be 64 lowercase hex characters"},
		{"retire: upper-case viewer", `SELECT buzz.retire_generation($1, 7)`, []any{upper(f.v)}, "invalid: p_viewer must be 64 lowercase hex characters"},
		{"retire: NULL generation", `SELECT buzz.retire_generation($1, NULL)`, []any{f.v}, "invalid: p_generation is NULL"},

		// operator views and fan-out bookkeeping
		{"lag detail: negative lim", `SELECT * FROM buzz.visibility_lag_detail(-1)`, nil, "invalid: lim must be 0 or more"},
		{"heartbeat: NULL instance", `SELECT buzz.instance_heartbeat(NULL, 'buzz_opin_x')`, nil, "invalid: p_instance is empty"},
		{"heartbeat: empty instance", `SELECT buzz.instance_heartbeat('', 'buzz_opin_x')`, nil, "invalid: p_instance is empty"},
		{"heartbeat: NULL slot", `SELECT buzz.instance_heartbeat('opin-x', NULL)`, nil, "invalid: p_slot is empty"},
		{"heartbeat: empty slot", `SELECT buzz.instance_heartbeat('opin-x', '')`, nil, "invalid: p_slot is empty"},
		{"reap: NULL p_stale", `SELECT * FROM buzz.reap_instances(NULL)`, nil, "invalid: p_stale must be an interval of zero or more"},
		{"reap: negative p_stale", `SELECT * FROM buzz.reap_instances('-1 second')`, nil, "invalid: p_stale must be an interval of zero or more"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			opinAssertRefused(t, pool, c.want, c.sql, c.args...)
		})
	}

	// The same functions with well-formed arguments, as the relay and operators call them.
	t.Run("well-formed calls still work", func(t *testing.T) {
		one := func(sql string, args ...any) string {
			t.Helper()
			var out *string
			if err := pool.QueryRow(ctx, sql, args...).Scan(&out); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
			if out == nil {
				return "<NULL>"
			}
			return *out
		}
		var hidden []string
		if err := pool.QueryRow(ctx, `SELECT hidden::text[] FROM buzz.visibility_source($1)`, f.v).Scan(&hidden); err != nil || !slices.Equal(hidden, []string{f.ch}) {
			t.Fatalf("visibility_source: %v %v, want [%s]", hidden, err, f.ch)
		}
		if got := one(`SELECT buzz.publish_visibility_snapshot($1, 1, $2::jsonb)`, f.v, f.evV); got != "published" {
			t.Fatalf("publish: %s", got)
		}
		g1, ev1 := opinSnapshot(t, pool, f.relaySK, f.v1)
		if got := one(`SELECT string_agg(outcome, ',') FROM buzz.publish_visibility_snapshots($1, $2, $3::jsonb[])`,
			[]string{f.v1, f.v2}, []int64{g1, 1}, []string{ev1, f.ev2}); got != "published,published" {
			t.Fatalf("batch publish: %s", got)
		}
		if got := one(`SELECT buzz.unhide_dm($1, $2::uuid)::text || buzz.hide_dm($1, $2::uuid)::text || buzz.set_dm_hidden($1, $2::uuid, false)::text`, f.v, f.ch); got != "truetruetrue" {
			t.Fatalf("unhide, hide, set_dm_hidden false: %s", got)
		}
		if got := one(`SELECT count(*)::text FROM buzz.claim_visibility_work(gen_random_uuid(), 0, '0 seconds')`); got != "0" {
			t.Fatalf("claim_visibility_work with max 0 and a lease already over: %s rows", got)
		}
		claim := one(`SELECT gen_random_uuid()::text`)
		if got := one(`SELECT string_agg(viewer, ',') FROM buzz.claim_visibility_work($1::uuid, 10, '1 minute')`, claim); got != f.v {
			t.Fatalf("claim_visibility_work claimed %s, want %s", got, f.v)
		}
		if got := one(`SELECT buzz.release_visibility_claim($1, $2::uuid, 'boom', '1 second', '1 minute')::text`, f.v, claim); got != "true" {
			t.Fatalf("release: %s", got)
		}
		if got := one(`SELECT buzz.release_visibility_claim($1, $2::uuid, 'boom', '1 second', '1 minute')::text`, f.r, f.claim); got != "true" {
			t.Fatalf("release of the fixture's claim: %s", got)
		}
		if got := one(`SELECT string_agg(id || ':' || stamp, ',' ORDER BY id) FROM buzz.claim_due_reminders(10, '1 minute')`); strings.Count(got, ",") != 1 {
			t.Fatalf("claim_due_reminders: %s, want the due and the stuck reminder", got)
		}
		if got := one(`SELECT count(*)::text FROM buzz.confirm_reminder_claims(
			ARRAY(SELECT id FROM buzz.reminders WHERE state = 'claimed' ORDER BY id),
			ARRAY(SELECT stamp FROM buzz.reminders WHERE state = 'claimed' ORDER BY id))`); got != "2" {
			t.Fatalf("confirm_reminder_claims: %s", got)
		}
		if got := one(`SELECT count(*)::text FROM buzz.rollback_reminder_claims('{}', '{}')`); got != "0" {
			t.Fatalf("rollback_reminder_claims of nothing: %s", got)
		}
		_, fresh := testenv.NewKey()
		snapExec(t, pool, `SELECT buzz.retire_generation($1, 3)`, fresh)
		snapExec(t, pool, `SELECT buzz.instance_heartbeat('opin-ok', 'buzz_opin_ok')`)
		if got := one(`SELECT (SELECT generation FROM buzz.visibility_retired WHERE viewer = $1)::text ||
			(SELECT count(*) FROM buzz.instances WHERE instance_id = 'opin-ok')::text`, fresh); got != "31" {
			t.Fatalf("retire_generation, instance_heartbeat: %s", got)
		}
		if got := one(`SELECT string_agg(action, ',') FROM buzz.reap_instances('1 hour')`); got != "slot dropped" {
			t.Fatalf("reap_instances: %s, want the fixture's slot without an instance row dropped", got)
		}
		for _, lim := range []string{"", "0", "NULL"} {
			one(`SELECT count(*)::text FROM buzz.visibility_lag_detail(` + lim + `)`)
		}
	})
}
