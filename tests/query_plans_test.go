package tests

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// REQ plans do not depend on whether autovacuum has analyzed a table that grew from empty: a few
// seconds after 20,000 events arrive through the relay, each filter shape walks an index in the
// REQ's order instead of sorting every matching row (buzz.refresh_statistics, sql/0007_upkeep.up.sql, called by
// the relay every StatisticsEvery). No manual ANALYZE.
func TestReqPlansUseIndexesAfterABulkLoad(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	// Autovacuum may get to a fresh table within the test's seconds, or not: without it, only
	// buzz.refresh_statistics can give the planner its statistics.
	for _, table := range []string{"buzz.events", "buzz.event_tags", "buzz.members"} {
		if _, err := pool.Exec(context.Background(),
			`ALTER TABLE `+table+` SET (autovacuum_enabled = false)`); err != nil {
			t.Fatal(err)
		}
	}
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: dbURL})
	aSK, aPK := testenv.NewKey()
	_, bPK := testenv.NewKey()
	setup := rbDial(t, r.URL)
	setup.Auth(aSK)
	channel := fanOpenDM(t, setup, fanUser{aSK, aPK}, bPK)

	const conns, perConn = 8, 2500
	var answered, refused atomic.Int64
	done := make(chan struct{}, conns)
	authors := make([]string, conns)
	var firstID string
	for i := range conns {
		sk, pk := testenv.NewKey()
		if i == 0 {
			sk, pk = aSK, aPK // its messages go to the DM
		}
		authors[i] = pk
		evs := make([]*nostr.Event, perConn)
		for j := range evs {
			if i == 0 && j%4 == 0 {
				evs[j] = rbSign(sk, 9, fmt.Sprint("dm ", j), nostr.Now(), nostr.Tag{"h", channel})
			} else {
				evs[j] = rbSign(sk, 1, fmt.Sprint("note ", i, " ", j), nostr.Now(), nostr.Tag{"t", fmt.Sprint("tag", j%50)})
			}
		}
		if i == 1 {
			firstID = evs[0].ID
		}
		c := testenv.Dial(t, r.URL, testenv.OnOK(func(_ string, ok bool, _ string, _ time.Time) {
			if !ok {
				refused.Add(1)
			}
			if answered.Add(1) == conns*perConn {
				close(done)
			}
		}))
		if i == 0 {
			c.Auth(aSK)
			answered.Add(-1) // the AUTH's OK
		}
		go func() {
			for _, ev := range evs {
				c.SendEvent(ev)
			}
		}()
	}
	select {
	case <-done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("%d of %d OKs", answered.Load(), conns*perConn)
	}
	if n := refused.Load(); n > 0 {
		t.Fatalf("%d events refused", n)
	}
	loaded := time.Now()

	const gate = ` AND (e.expires_at IS NULL OR e.expires_at > floor(extract(epoch from statement_timestamp()))::bigint)` +
		` AND e.scope = '*'`
	const byEvent = gate + ` ORDER BY e.created_at DESC, e.id LIMIT 100`
	// A tag filter walks buzz.event_tags in its own order (relay/filter_sql.go, reqPartSQL).
	const byTag = gate + ` ORDER BY t0.created_at DESC, t0.event_id LIMIT 100`
	const events, tagged = `SELECT e.id FROM buzz.events e WHERE `,
		`SELECT e.id FROM buzz.event_tags t0 JOIN buzz.events e ON e.id = t0.event_id WHERE `
	shapes := map[string]string{
		"kinds":         events + `e.kind = 1` + byEvent,
		"#h":            tagged + fmt.Sprintf(`t0.tagval = 'h:%s'`, channel) + byTag,
		"#t":            tagged + `t0.tagval = 't:tag7'` + byTag,
		"#t+kinds":      tagged + `t0.tagval = 't:tag7' AND e.kind = 1` + byTag,
		"authors+kinds": events + fmt.Sprintf(`e.pubkey = '%s' AND e.kind = 1`, authors[1]) + byEvent,
		"ids":           events + fmt.Sprintf(`e.id = ANY(ARRAY['%s', '%s']::text[])`, firstID, strings.Repeat("0", 64)) + byEvent,
	}
	var bad map[string]string
	for {
		bad = map[string]string{}
		for name, query := range shapes {
			plan := explain(t, pool, query)
			// ids: a sort of the rows named (a primary-key lookup) is no full sort.
			sorts := strings.Contains(plan, "Sort") && name != "ids"
			if strings.Contains(plan, "Seq Scan") || sorts || !strings.Contains(plan, "Index") {
				bad[name] = plan
			}
		}
		if len(bad) == 0 {
			t.Logf("plans use indexes %v after the load", time.Since(loaded).Round(100*time.Millisecond))
			return
		}
		if time.Since(loaded) > 15*time.Second {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	for name, plan := range bad {
		t.Errorf("%s: 15 s after the load the plan still sorts or scans the table:\n%s", name, plan)
	}
}

// explain is the plan of sql, one line per node.
func explain(t *testing.T, pool *pgxpool.Pool, sql string) string {
	t.Helper()
	return strings.Join(testenv.MustColumn[string](t, pool, `EXPLAIN `+sql), "\n")
}
