package tests

// I2 across a crash: a `buzzpg serve` process dies (SIGKILL) holding an outbox claim.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
	"github.com/buzzpg/buzzpg/listener/visibility"
)

// claimAudit records every claim of a visibility outbox row: which claim id took it, until when,
// and from which process (the claimer's application_name, buzzpg-listener:<instance>). The
// outbox itself only keeps the current claim, and the row is gone once published.
func claimAudit(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	snapExec(t, pool, `
		CREATE TABLE public.claim_audit (seq bigserial PRIMARY KEY, viewer text, generation bigint,
		  claim_id uuid, lease_until timestamptz, claimed_at timestamptz, app text);
		CREATE FUNCTION public.claim_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  INSERT INTO public.claim_audit (viewer, generation, claim_id, lease_until, claimed_at, app)
		  VALUES (NEW.viewer, NEW.generation, NEW.claim_id, NEW.lease_until, now(),
		          current_setting('application_name'));
		  RETURN NULL;
		END $$;
		CREATE TRIGGER claim_audit AFTER UPDATE ON buzz.visibility_outbox
		  FOR EACH ROW WHEN (NEW.claim_id IS NOT NULL AND NEW.claim_id IS DISTINCT FROM OLD.claim_id)
		  EXECUTE FUNCTION public.claim_audit_fn();`)
}

type claimRec struct {
	generation          int64
	claim, app          string
	leaseUntil, claimed time.Time
}

func (c claimRec) String() string {
	return fmt.Sprintf("{g %d claim %.8s by %s at %s, lease until %s}", c.generation, c.claim, c.app,
		c.claimed.Format("15:04:05.000"), c.leaseUntil.Format("15:04:05.000"))
}

func claimsOf(t testing.TB, pool *pgxpool.Pool, viewer string) []claimRec {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT generation, claim_id::text, app, lease_until, claimed_at
		FROM public.claim_audit WHERE viewer = $1 ORDER BY seq`, viewer)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []claimRec
	for rows.Next() {
		var c claimRec
		if err := rows.Scan(&c.generation, &c.claim, &c.app, &c.leaseUntil, &c.claimed); err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Two `buzzpg serve` processes with a short outbox lease. A change makes one viewer pending;
// whichever process claims it stops at publish.before_fence (its claim committed, nothing
// published) and is killed with SIGKILL there. Nothing is written afterwards: the survivor must
// take the row again once the lease has expired and publish the viewer's state. The audit shows
// the row claimed exactly twice: by the dead process, then by the survivor after the lease.
func TestSnapshotServeCrashHoldingClaimRecovered(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	relayKey, relayPK := testenv.NewKey()
	snapExec(t, pool, `UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, relayPK)
	testenv.SnapshotAudit(t, pool)
	claimAudit(t, pool)

	const lease = 2 * time.Second
	env := map[string]string{"BUZZ_LEASE": lease.String(), "BUZZ_SWEEP_INTERVAL": "500ms"}
	dirs := [2]string{t.TempDir(), t.TempDir()}
	var relays [2]*testenv.Relay
	for i := range relays {
		relays[i] = testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL, RelayKey: relayKey, Env: env,
			InstanceID: fmt.Sprintf("crash%d_%d", i, time.Now().UnixNano()%1e9),
			HookDir:    dirs[i], Hooks: []string{visibility.HookBeforeFence}})
	}

	viewer, ch := snapSQLDM(t, pool)
	snapExec(t, pool, `SELECT buzz.hide_dm($1, $2::uuid)`, viewer, ch)
	target, published := snapGens(t, pool, viewer)
	if target != published+1 {
		t.Fatalf("hide: target %d published %d", target, published)
	}

	// Whichever process claimed the row stops at the hook: that one dies.
	x := -1
	testenv.WaitUntil(t, 30*time.Second, "a process at "+visibility.HookBeforeFence, func() bool {
		for i, d := range dirs {
			if _, err := os.Stat(filepath.Join(d, visibility.HookBeforeFence+".reached")); err == nil {
				x = i
				return true
			}
		}
		return false
	})
	y := 1 - x
	hooks.Release(t, dirs[y], visibility.HookBeforeFence) // the survivor passes its hook
	relays[x].Kill()
	if code := relays[x].ExitCode(); code != -1 {
		t.Fatalf("the claimer exited with %d, want death by signal", code)
	}
	held := claimsOf(t, pool, viewer)
	if len(held) != 1 || held[0].app != "buzzpg-listener:"+relays[x].InstanceID {
		t.Fatalf("claims when the claimer died: %v, want one by %s", held, relays[x].InstanceID)
	}
	if _, p := snapGens(t, pool, viewer); p != published {
		t.Fatalf("published moved to %d before the claimer died", p)
	}

	// No new writes from here on: only the expired lease lets the survivor in.
	testenv.WaitUntil(t, 30*time.Second, "the viewer converged on the survivor", func() bool {
		tg, p := snapGens(t, pool, viewer)
		return tg == target && p == target
	})
	if _, hs := snapHead(t, pool, viewer); !slices.Equal(hs, []string{ch}) {
		t.Fatalf("head says hidden %v, want [%s]", hs, ch)
	}
	if gens := snapAssertAudit(t, pool, viewer); !slices.Equal(gens, []int64{target}) {
		t.Fatalf("publications %v, want one of generation %d", gens, target)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM buzz.visibility_outbox WHERE viewer = $1`, viewer).Scan(&rows); err != nil || rows != 0 {
		t.Fatalf("outbox rows left for the viewer: %d (%v)", rows, err)
	}
	claims := claimsOf(t, pool, viewer)
	if len(claims) != 2 {
		t.Fatalf("the row was claimed %d times (%v), want twice: by the dead process, then by the survivor", len(claims), claims)
	}
	first, second := claims[0], claims[1]
	if first.claim == second.claim || second.app != "buzzpg-listener:"+relays[y].InstanceID ||
		first.generation != target || second.generation != target {
		t.Fatalf("claims %v, want the second by %s under a new claim id, both for generation %d", claims, relays[y].InstanceID, target)
	}
	t.Logf("claims: %v", claims)
	if second.claimed.Before(first.leaseUntil) {
		t.Fatalf("re-claimed at %s, before the dead claim's lease ended (%s)", second.claimed, first.leaseUntil)
	}
}
