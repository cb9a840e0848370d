package tests

// Helpers of the NIP-DV (kind 30622) black-box tests: signed events and SQL probes (the WebSocket
// client is testenv.Client).

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

var snapNonce atomic.Int64

func snapEvent(t testing.TB, sk string, kind int, content string, tags ...nostr.Tag) *nostr.Event {
	t.Helper()
	tags = append(tags, nostr.Tag{"nonce", fmt.Sprint(snapNonce.Add(1))})
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: tags, Content: content}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// snapHidden returns an event's h tag values, sorted.
func snapHidden(ev *nostr.Event) []string {
	hs := []string{}
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == "h" {
			hs = append(hs, t[1])
		}
	}
	slices.Sort(hs)
	return hs
}

func snapExec(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("exec %q: %v", sql, err)
	}
}

// snapSQLDM opens a DM of a fresh viewer with one other participant, straight in SQL, and
// returns the viewer and the channel id.
func snapSQLDM(t testing.TB, pool *pgxpool.Pool) (viewer, ch string) {
	t.Helper()
	_, viewer = testenv.NewKey()
	_, other := testenv.NewKey()
	if err := pool.QueryRow(context.Background(), `SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, viewer, other).Scan(&ch); err != nil {
		t.Fatal(err)
	}
	return viewer, ch
}

// snapGens returns the viewer's generations, zero for a viewer with no state row yet; any other
// query error fails the test (it must not read as 0/0, which is "converged").
func snapGens(t testing.TB, pool *pgxpool.Pool, viewer string) (target, published int64) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT target_generation, published_generation
		FROM buzz.visibility_state WHERE viewer = $1`, viewer).Scan(&target, &published)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("generations of %.8s: %v", viewer, err)
	}
	return
}

// snapHead returns the viewer's only stored 30622 and its hidden set (fails if there are several).
func snapHead(t testing.TB, pool *pgxpool.Pool, viewer string) (*nostr.Event, []string) {
	t.Helper()
	var ids []string
	var raw []byte
	if err := pool.QueryRow(context.Background(), `SELECT array_agg(id), (array_agg(jsonb_build_object(
		  'id', id, 'pubkey', pubkey, 'created_at', created_at, 'kind', kind, 'tags', tags,
		  'content', content, 'sig', sig)))[1]
		FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, viewer).Scan(&ids, &raw); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 {
		t.Fatalf("viewer %.8s has %d snapshot heads", viewer, len(ids))
	}
	ev := &nostr.Event{}
	if err := ev.UnmarshalJSON(raw); err != nil {
		t.Fatal(err)
	}
	if ok, _ := ev.CheckSignature(); !ok || !ev.CheckID() {
		t.Fatalf("snapshot %s: bad id or signature", ev.ID)
	}
	return ev, snapHidden(ev)
}

// snapAssertAudit: per viewer, generations and created_at strictly rise in publication order.
func snapAssertAudit(t testing.TB, pool *pgxpool.Pool, viewer string) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT generation, created_at FROM public.snapshot_audit
		WHERE viewer = $1 ORDER BY seq`, viewer)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var gens []int64
	var lastG, lastC int64 = -1, -1
	for rows.Next() {
		var g, c int64
		if err := rows.Scan(&g, &c); err != nil {
			t.Fatal(err)
		}
		if g <= lastG || c <= lastC {
			t.Errorf("publication (g %d, created_at %d) after (g %d, created_at %d)", g, c, lastG, lastC)
		}
		gens = append(gens, g)
		lastG, lastC = g, c
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return gens
}

func snapLogHas(r *testenv.Relay, parts ...string) bool {
	for _, line := range strings.Split(r.Log(), "\n") {
		all := true
		for _, p := range parts {
			if !strings.Contains(line, p) {
				all = false
				break
			}
		}
		if all {
			return true
		}
	}
	return false
}
