package ops

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// loginRole creates a login role with the given extra clauses, dropped (with what it owns in the
// test's database) at cleanup; roles are cluster-wide, so the name is random.
func loginRole(t *testing.T, admin *pgxpool.Pool, prefix, clauses string) string {
	t.Helper()
	role := prefix + testenv.NewUser().PK[:12]
	if _, err := admin.Exec(context.Background(), `CREATE ROLE `+role+` LOGIN `+clauses); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		for _, q := range []string{`DROP OWNED BY ` + role, `DROP ROLE ` + role} {
			if _, err := admin.Exec(ctx, q); err != nil {
				t.Logf("%s: %v", q, err)
			}
		}
	})
	return role
}

// shadowFunctions are what a role that may create in public puts there: functions and operators
// that match the arguments of calls in buzz's SQL better than the built-ins do (polymorphic
// built-ins, an integer where the built-in takes a bigint), each recording its call and then
// doing what the built-in does. The first also tries to make its caller's session superuser.
var shadowFunctions = []struct{ name, args, returns, body string }{
	{"hashtextextended", "t text, s integer", "bigint", `
		BEGIN EXECUTE format('ALTER ROLE %I SUPERUSER', '{{attacker}}'); EXCEPTION WHEN OTHERS THEN NULL; END;
		RETURN pg_catalog.hashtextextended(t, s::bigint);`},
	{"array_length", "a text[], d integer", "integer", `RETURN pg_catalog.array_length(a, d);`},
	{"array_length", "a uuid[], d integer", "integer", `RETURN pg_catalog.array_length(a, d);`},
	{"array_length", "a bigint[], d integer", "integer", `RETURN pg_catalog.array_length(a, d);`},
	{"array_length", "a jsonb[], d integer", "integer", `RETURN pg_catalog.array_length(a, d);`},
	{"array_lower", "a text[], d integer", "integer", `RETURN pg_catalog.array_lower(a, d);`},
	{"array_ndims", "a text[]", "integer", `RETURN pg_catalog.array_ndims(a);`},
	{"cardinality", "a text[]", "integer", `RETURN pg_catalog.cardinality(a);`},
	{"array_to_string", "a text[], s text", "text", `RETURN pg_catalog.array_to_string(a, s);`},
	{"unnest", "a text[]", "SETOF text", `RETURN QUERY SELECT pg_catalog.unnest(a);`},
	{"unnest", "a bigint[]", "SETOF bigint", `RETURN QUERY SELECT pg_catalog.unnest(a);`},
	{"unnest", "a uuid[]", "SETOF uuid", `RETURN QUERY SELECT pg_catalog.unnest(a);`},
	{"power", "a integer, b integer", "double precision", `RETURN pg_catalog.power(a::float8, b::float8);`},
	{"to_jsonb", "a text", "jsonb", `RETURN pg_catalog.to_jsonb(a);`},
	{"shadow_text_arr_eq", "a text[], b text[]", "boolean", `RETURN a OPERATOR(pg_catalog.=) b;`},
	{"shadow_text_arr_overlap", "a text[], b text[]", "boolean", `RETURN a OPERATOR(pg_catalog.&&) b;`},
	{"shadow_text_arr_contains", "a text[], b text[]", "boolean", `RETURN a OPERATOR(pg_catalog.@>) b;`},
	{"shadow_text_arr_append", "s text[], v text", "text[]", `RETURN pg_catalog.array_append(s, v);`},
}

var shadowOperators = []string{
	`CREATE OPERATOR public.= (LEFTARG = text[], RIGHTARG = text[], FUNCTION = public.shadow_text_arr_eq)`,
	`CREATE OPERATOR public.&& (LEFTARG = text[], RIGHTARG = text[], FUNCTION = public.shadow_text_arr_overlap)`,
	`CREATE OPERATOR public.@> (LEFTARG = text[], RIGHTARG = text[], FUNCTION = public.shadow_text_arr_contains)`,
	`CREATE AGGREGATE public.array_agg(text) (SFUNC = public.shadow_text_arr_append, STYPE = text[])`,
}

const shadowLockClass = 4242

// shadowCalls lists the planted objects that ran, by whom and how often: recorded rows, and locks
// taken where a row could not be written.
func shadowCalls(t *testing.T, admin *pgxpool.Pool) []string {
	t.Helper()
	ctx := context.Background()
	rows, err := admin.Query(ctx, `SELECT fn || ' as ' || by_role || ' (' || split_part(app, ':', 1) || ') x' || count(*)
		FROM public.shadow_calls GROUP BY fn, by_role, split_part(app, ':', 1) ORDER BY min(at)`)
	if err != nil {
		t.Fatal(err)
	}
	calls, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	locked := testenv.MustColumn[int64](t, admin, `SELECT objid::int8 FROM pg_locks
		WHERE locktype = 'advisory' AND classid = $1 AND objsubid = 2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, shadowLockClass)
	for _, i := range locked {
		f := shadowFunctions[i]
		calls = append(calls, f.name+"("+f.args+") in a read-only transaction")
	}
	return calls
}

// plantShadows creates, as attacker, the shadowing objects in public and the table they record to.
func plantShadows(t *testing.T, ctx context.Context, attackerURL, attacker string) {
	t.Helper()
	c, err := pgx.Connect(ctx, attackerURL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	stmts := []string{
		`CREATE TABLE public.shadow_calls (fn text, by_role text DEFAULT current_user,
		   app text DEFAULT current_setting('application_name', true), at timestamptz DEFAULT clock_timestamp())`,
		`GRANT INSERT ON public.shadow_calls TO PUBLIC`,
	}
	// A read-only transaction (a REQ's) cannot insert: the call then takes a session advisory lock
	// (shadowLockClass, the function's index), which the test finds in pg_locks.
	for i, f := range shadowFunctions {
		body := strings.ReplaceAll(f.body, "{{attacker}}", attacker)
		stmts = append(stmts, fmt.Sprintf(`CREATE FUNCTION public.%s(%s) RETURNS %s LANGUAGE plpgsql AS $f$
			BEGIN
			  BEGIN INSERT INTO public.shadow_calls (fn) VALUES ('%s(%s)');
			  EXCEPTION WHEN OTHERS THEN PERFORM pg_catalog.pg_advisory_lock(%d, %d); END;
			  %s
			END $f$`, f.name, f.args, f.returns, f.name, f.args, shadowLockClass, i, body))
	}
	for _, q := range append(stmts, shadowOperators...) {
		if _, err := c.Exec(ctx, q); err != nil {
			t.Fatalf("as %s: %s: %v", attacker, q, err)
		}
	}
}

// A role that may create objects in public (every role before PostgreSQL 15; here granted
// explicitly) plants functions and operators there that shadow built-ins buzz's SQL calls. Then
// the whole acceptance path (notes, a DM with its commands and messages, deletions, replaceable
// and addressable events, queries), the snapshot publication (a hide by command and by the
// operator) and a reminder's firing run through a real `buzzpg serve`. None of the planted
// objects ever runs, and the attacker never becomes superuser: every buzz function pins its
// search_path, and so do the relay's connections.
func TestShadowObjectsInPublicNeverRun(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	admin := testenv.Pool(t, dbURL)
	ctx := context.Background()
	attacker := loginRole(t, admin, "lp_atk_", "")
	opRole := loginRole(t, admin, "lp_op_", "IN ROLE buzz_operator")
	if _, err := admin.Exec(ctx, `GRANT CREATE ON SCHEMA public TO `+attacker); err != nil {
		t.Fatal(err)
	}
	plantShadows(t, ctx, testenv.AsRole(t, dbURL, attacker), attacker)
	// Checked however the paths below end (a planted object that fails can break one).
	defer func() {
		if calls := shadowCalls(t, admin); len(calls) > 0 {
			t.Errorf("objects planted in public ran: %s", strings.Join(calls, "; "))
		}
		if testenv.MustScalar[bool](t, admin, `SELECT rolsuper FROM pg_roles WHERE rolname = $1`, attacker) {
			t.Errorf("%s became superuser", attacker)
		}
	}()

	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	a, b, c := testenv.NewUser(), testenv.NewUser(), testenv.NewUser()
	ca, cb := testenv.Dial(t, r.URL), testenv.Dial(t, r.URL)
	ca.Auth(a.SK)
	cb.Auth(b.SK)

	// A group DM opened by command, hidden by command (a snapshot), a message that resurfaces it.
	msg := ca.MustPublish(a.Event(t, 41010, nostr.Tags{{"p", b.PK}, {"p", c.PK}}, ""))
	ch := testenv.DMChannelID(t, msg)
	snaps := cb.Subscribe(nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": {b.PK}}})
	inDM := cb.Subscribe(nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": {ch}}})
	cb.MustPublish(b.Event(t, 41012, nostr.Tags{{"h", ch}}, ""))
	snaps.WaitN(1, 20*time.Second)
	hello := a.Event(t, 9, nostr.Tags{{"h", ch}}, "hello")
	ca.MustPublish(hello)
	inDM.WaitEvents(20*time.Second, hello.ID)
	snaps.WaitN(2, 20*time.Second)

	// The operator hides it for A: another viewer's snapshot.
	op, err := pgxpool.New(ctx, testenv.AsRole(t, dbURL, opRole))
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close()
	if hid := testenv.MustScalar[bool](t, op, `SELECT buzz.hide_dm($1, $2::uuid)`, a.PK, ch); !hid {
		t.Fatal("hide_dm changed nothing")
	}
	testenv.WaitUntil(t, 20*time.Second, "A's snapshot", func() bool {
		return testenv.MustInt(t, admin, `SELECT count(*) FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, a.PK) == 1
	})

	// Notes, a deletion, replaceable and addressable events, and queries over them.
	note := a.Event(t, 1, nostr.Tags{{"t", "x"}}, "note")
	ca.MustPublish(note)
	ca.MustPublish(a.Event(t, 5, nostr.Tags{{"e", note.ID}}, ""))
	ca.MustPublish(a.EventAt(t, 0, nil, `{"name":"a"}`, nostr.Now()-10))
	ca.MustPublish(a.Event(t, 0, nil, `{"name":"a2"}`))
	art := a.Event(t, 30023, nostr.Tags{{"d", "post"}}, "v1")
	ca.MustPublish(art)
	ca.MustPublish(a.Event(t, 5, nostr.Tags{{"a", fmt.Sprintf("30023:%s:post", a.PK)}}, ""))
	if got := ca.Req(nostr.Filter{IDs: []string{note.ID, art.ID}}).Events(); len(got) != 0 {
		t.Fatalf("deleted events still served (%d)", len(got))
	}
	if got := ca.Req(nostr.Filter{Kinds: []int{0}, Authors: []string{a.PK}}).Events(); len(got) != 1 {
		t.Fatalf("replaceable kind 0: %d heads served", len(got))
	}
	if got := cb.Req(nostr.Filter{Tags: nostr.TagMap{"h": {ch}}}).Events(); len(got) == 0 {
		t.Fatal("the DM's history is empty")
	}

	// A reminder due now is claimed and confirmed, its due signal emitted.
	remindNowAndWaitConfirmed(t, ca, a, admin)
}

// The fan-out delivers what arrives as a logical message with prefix 'buzz', so writing one is
// the relay role's (and the owner's) privilege: a login role with no grants is refused.
func TestLogicalMessagesNeedTheRelayRole(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	admin := testenv.Pool(t, dbURL)
	ctx := context.Background()
	nobody := loginRole(t, admin, "lp_nobody_", "")
	relay := loginRole(t, admin, "lp_relay_", "IN ROLE buzz_relay")
	emit := `SELECT pg_logical_emit_message(true, 'buzz', '{"t":"members","all":true}')::text`
	for _, role := range []string{nobody, relay} {
		c, err := pgx.Connect(ctx, testenv.AsRole(t, dbURL, role))
		if err != nil {
			t.Fatal(err)
		}
		var lsn string
		err = c.QueryRow(ctx, emit).Scan(&lsn)
		c.Close(ctx)
		switch {
		case role == nobody && db.SQLState(err) != "42501":
			t.Errorf("a role with no grants emitting a 'buzz' message: err %v (SQLSTATE %q), want 42501", err, db.SQLState(err))
		case role == relay && err != nil:
			t.Errorf("a member of buzz_relay emitting a 'buzz' message: %v", err)
		}
	}
}

// Migrations run by an owner that is not a superuser (as on a managed service) complete: the
// grants of pg_logical_emit_message, which only its owner may change, are left as they were
// (PUBLIC keeps it), and the relay role's entry points, which run as that owner, work.
func TestMigrationsByAnOwnerThatIsNotSuperuser(t *testing.T) {
	dbURL := testenv.EmptyDB(t)
	admin := testenv.Pool(t, dbURL)
	ctx := context.Background()
	owner := loginRole(t, admin, "lp_owner_", "")
	for _, q := range []string{
		`GRANT CREATE ON DATABASE ` + pgx.Identifier{testenv.DatabaseName(dbURL)}.Sanitize() + ` TO ` + owner,
		`GRANT CREATE ON SCHEMA public TO ` + owner,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	if err := db.MigrateUp(testenv.AsRole(t, dbURL, owner), nil); err != nil {
		t.Fatalf("migrate up as %s: %v", owner, err)
	}
	if public := testenv.MustScalar[bool](t, admin, `SELECT bool_and(EXISTS (
		SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a WHERE a.grantee = 0))
		FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'`); !public {
		t.Error("a migrating role that is not a superuser changed pg_logical_emit_message's grants")
	}
	u := testenv.NewUser()
	raw, _ := json.Marshal(u.Event(t, 1, nil, "hello"))
	if err := asRole(t, admin, "buzz_relay", true, `SELECT * FROM buzz.accept_event($1::jsonb)`, string(raw)); err != nil {
		t.Fatalf("accept_event as buzz_relay, owned by %s: %v", owner, err)
	}
	if n := testenv.MustInt(t, admin, `SELECT count(*) FROM buzz.events WHERE pubkey = $1`, u.PK); n != 1 {
		t.Fatalf("%d events stored", n)
	}
}
