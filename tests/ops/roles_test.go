package ops

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A relay whose login role is only a member of buzz_relay (plus REPLICATION) runs every path:
// acceptance, DM commands, snapshots, reminders, deletions, queries and the replication stream,
// and posts with `buzzpg send`. An operator role that is only a member of buzz_operator uses the
// psql tour, and may not send (that is signing as the relay). Every test relay runs as such a
// role (testenv.RelayLogin); this one makes its own, with nothing but the memberships.
func TestRelayAndOperatorRunWithTheirRolesOnly(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	admin := testenv.Pool(t, dbURL)
	ctx := context.Background()
	// Roles are cluster-wide: random names, so parallel runs on one server cannot collide.
	suffix := testenv.NewUser().PK[:12]
	relayRole, opRole := "lp_relay_"+suffix, "lp_op_"+suffix
	t.Cleanup(func() { // after the relay stopped (cleanups run last-in first-out)
		for _, r := range []string{relayRole, opRole} {
			if _, err := admin.Exec(context.Background(), `DROP ROLE IF EXISTS `+r); err != nil {
				t.Logf("drop role %s: %v", r, err)
			}
		}
	})
	for _, q := range []string{
		`CREATE ROLE ` + relayRole + ` LOGIN REPLICATION IN ROLE buzz_relay`,
		`CREATE ROLE ` + opRole + ` LOGIN IN ROLE buzz_operator`,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}

	relayKey, _ := testenv.NewKey()
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: testenv.AsRole(t, dbURL, relayRole), RelayKey: relayKey,
		Env: map[string]string{"BUZZ_AUTO_MIGRATE": "false"}})
	a, b := testenv.NewUser(), testenv.NewUser()
	ca, cb := testenv.Dial(t, r.URL), testenv.Dial(t, r.URL)
	ca.Auth(a.SK)
	cb.Auth(b.SK)

	// A DM, hidden by B: B's snapshot is published (publisher) and reaches B live (fan-out).
	msg := ca.MustPublish(a.Event(t, 41010, nostr.Tags{{"p", b.PK}}, ""))
	ch := testenv.DMChannelID(t, msg)
	snaps := cb.Subscribe(nostr.Filter{Kinds: []int{30622}, Tags: nostr.TagMap{"p": {b.PK}}})
	cb.MustPublish(b.Event(t, 41012, nostr.Tags{{"h", ch}}, ""))
	snaps.WaitN(1, 20*time.Second)

	// A message resurfaces the DM for B: delivered live, and a second snapshot.
	inDM := cb.Subscribe(nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": {ch}}})
	hello := a.Event(t, 9, nostr.Tags{{"h", ch}}, "hello")
	ca.MustPublish(hello)
	inDM.WaitEvents(20*time.Second, hello.ID)
	snaps.WaitN(2, 20*time.Second)

	// A reminder due now is claimed and confirmed by the scheduler.
	remindNowAndWaitConfirmed(t, ca, a, admin)

	// A deletion, and a query that no longer finds the deleted note.
	note := a.Event(t, 1, nil, "note")
	ca.MustPublish(note)
	ca.MustPublish(a.Event(t, 5, nostr.Tags{{"e", note.ID}}, ""))
	if got := ca.Req(nostr.Filter{IDs: []string{note.ID}}).Events(); len(got) != 0 {
		t.Fatalf("the deleted note is still served (%d)", len(got))
	}

	// `buzzpg send` signs with the relay key: the relay's role, not the operator's.
	out, code := runBinary(t, []string{"DATABASE_URL=" + testenv.AsRole(t, dbURL, relayRole), "BUZZ_RELAY_KEY=" + relayKey},
		"send", "--channel", ch, "--as", a.PK, "deploy finished")
	if code != 0 {
		t.Fatalf("send as %s: exit %d: %s", relayRole, code, out)
	}
	out, code = runBinary(t, []string{"DATABASE_URL=" + testenv.AsRole(t, dbURL, opRole), "BUZZ_RELAY_KEY=" + relayKey},
		"send", "--channel", ch, "--as", a.PK, "deploy finished")
	if code == 0 || !strings.Contains(out, "permission denied for function accept_event") {
		t.Fatalf("send as %s: exit %d: %s, want permission denied for accept_event", opRole, code, out)
	}

	// The operator's psql tour.
	op, err := pgxpool.New(ctx, testenv.AsRole(t, dbURL, opRole))
	if err != nil {
		t.Fatal(err)
	}
	defer op.Close()
	for _, q := range []string{
		`SELECT count(*) FROM buzz.visibility_lag()`,
		`SELECT count(*) FROM buzz.visibility_lag_detail()`,
		`SELECT count(*) FROM buzz.reminder_status()`,
		`SELECT count(*) FROM buzz.fanout_status()`,
		`SELECT count(*) FROM buzz.events WHERE kind = 30622 AND d_tag = '` + b.PK + `'`,
		`SELECT count(*) FROM (SELECT buzz.hide_dm('` + a.PK + `', '` + ch + `'::uuid)) s`,
		`SELECT count(*) FROM (SELECT buzz.unhide_dm('` + a.PK + `', '` + ch + `'::uuid)) s`,
		`SELECT count(*) FROM (SELECT buzz.retry_visibility()) s`,
		`SELECT count(*) FROM (SELECT buzz.reset_visibility('` + b.PK + `')) s`,
	} {
		var n int
		if err := op.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatalf("as %s: %s: %v", opRole, q, err)
		}
	}
}
