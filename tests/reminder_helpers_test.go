package tests

// Helpers of the NIP-ER reminder tests (prefix rem, so they cannot collide with other areas'
// helpers in this package).

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

var remNonce atomic.Int64

// remEvent signs a kind 30300 by sk with d tag d and extra tags; the content is a nonce so two
// versions in the same second differ.
func remEvent(t testing.TB, sk string, created int64, d string, extra ...nostr.Tag) *nostr.Event {
	t.Helper()
	tags := nostr.Tags{}
	if d != "" {
		tags = append(tags, nostr.Tag{"d", d})
	}
	tags = append(tags, extra...)
	ev := &nostr.Event{Kind: 30300, CreatedAt: nostr.Timestamp(created), Tags: tags,
		Content: fmt.Sprintf("enc%d", remNonce.Add(1))}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

func remNB(nb int64) nostr.Tag { return nostr.Tag{"not_before", fmt.Sprint(nb)} }

// remAccept stores ev through buzz.accept_event (the signature was checked by Sign's caller).
func remAccept(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, ev *nostr.Event) (ok bool, msg string, err error) {
	raw, _ := json.Marshal(ev)
	err = q.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg)
	return
}

func remMustAccept(t testing.TB, pool *pgxpool.Pool, ev *nostr.Event) {
	t.Helper()
	ok, msg, err := remAccept(context.Background(), pool, ev)
	if err != nil || !ok {
		t.Fatalf("accept kind %d %s: ok=%v msg=%q err=%v", ev.Kind, ev.ID, ok, msg, err)
	}
}

// remDue stores a reminder that is already due (not_before in the past) and returns it.
func remDue(t testing.TB, pool *pgxpool.Pool) *nostr.Event {
	t.Helper()
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	ev := remEvent(t, sk, now, "r", remNB(now-2))
	remMustAccept(t, pool, ev)
	return ev
}

type remRowQuerier interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}

func remClaim(t testing.TB, q remRowQuerier, ev *nostr.Event) *int64 {
	t.Helper()
	stamp, err := remClaimErr(q, ev)
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	return stamp
}

// remClaimErr is remClaim for goroutines other than the test's: it returns the error.
func remClaimErr(q remRowQuerier, ev *nostr.Event) (*int64, error) {
	var stamp *int64
	err := q.QueryRow(context.Background(), `SELECT buzz.claim_due_reminder($1, $2)`, ev.ID, int64(ev.CreatedAt)).Scan(&stamp)
	return stamp, err
}

func remClaimLease(t testing.TB, pool *pgxpool.Pool, ev *nostr.Event, lease time.Duration) *int64 {
	t.Helper()
	var stamp *int64
	if err := pool.QueryRow(context.Background(), `SELECT buzz.claim_due_reminder($1, $2, $3)`, ev.ID, int64(ev.CreatedAt), lease).Scan(&stamp); err != nil {
		t.Fatalf("claim: %v", err)
	}
	return stamp
}

func remBoolCall(t testing.TB, pool *pgxpool.Pool, fn string, ev *nostr.Event, stamp int64) bool {
	t.Helper()
	var ok bool
	if err := pool.QueryRow(context.Background(), `SELECT buzz.`+fn+`($1, $2, $3)`, ev.ID, int64(ev.CreatedAt), stamp).Scan(&ok); err != nil {
		t.Fatalf("%s: %v", fn, err)
	}
	return ok
}

type remRow struct {
	State                     string
	Stamp                     *int64
	Claims, Recoveries, Rolls int
}

func remGet(t testing.TB, pool *pgxpool.Pool, id string) remRow {
	t.Helper()
	var r remRow
	err := pool.QueryRow(context.Background(),
		`SELECT state, stamp, claims, recoveries, rollbacks FROM buzz.reminders WHERE id = $1`, id).
		Scan(&r.State, &r.Stamp, &r.Claims, &r.Recoveries, &r.Rolls)
	if err != nil {
		t.Fatalf("read reminder %s: %v", id, err)
	}
	return r
}

// remWaitLeaseExpired waits until the row's lease is behind the database clock (observable
// state, so no timing guess about when "short" has passed).
func remWaitLeaseExpired(t testing.TB, pool *pgxpool.Pool, id string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var expired bool
		_ = pool.QueryRow(context.Background(),
			`SELECT lease_until < clock_timestamp() FROM buzz.reminders WHERE id = $1`, id).Scan(&expired)
		if expired {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("lease of %s did not expire", id)
}

// remSlot is a test_decoding logical slot on a FreshDB: it shows every logical message emitted
// (transactional ones only once their transaction committed).
type remSlot struct {
	name string
	pool *pgxpool.Pool
}

func remNewSlot(t testing.TB, pool *pgxpool.Pool) *remSlot {
	t.Helper()
	name := fmt.Sprintf("remtest_%d", time.Now().UnixNano()%1e12)
	if _, err := pool.Exec(context.Background(), `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, name); err != nil {
		t.Fatalf("create slot: %v", err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, name) })
	return &remSlot{name, pool}
}

// dueMessages consumes the slot and returns the due signals emitted since the last call, one
// entry per signal (a batch confirm's "dues" message is split into its items).
func (s *remSlot) dueMessages(t testing.TB) []map[string]any {
	t.Helper()
	rows, err := s.pool.Query(context.Background(), `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, s.name)
	if err != nil {
		t.Fatalf("read slot: %v", err)
	}
	defer rows.Close()
	var out []map[string]any
	for rows.Next() {
		var data string
		if err := rows.Scan(&data); err != nil {
			t.Fatal(err)
		}
		sigs, err := testenv.DueSignals(data)
		if err != nil {
			t.Fatal(err)
		}
		for _, sig := range sigs {
			out = append(out, map[string]any{"t": "due", "ev": sig.Event, "stamp": sig.Stamp, "scope": sig.Scope})
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// remAssertDistinctStamps fails unless no stamp occurs twice across sets (I5: a stamp names one
// claim of one row).
func remAssertDistinctStamps(t testing.TB, what string, sets ...[]int64) {
	t.Helper()
	seen := map[int64]int{}
	n := 0
	for _, set := range sets {
		for _, s := range set {
			seen[s]++
			n++
		}
	}
	if len(seen) == n {
		return
	}
	var dups []string
	for s, c := range seen {
		if c > 1 && len(dups) < 5 {
			dups = append(dups, fmt.Sprintf("%d (%d times)", s, c))
		}
	}
	t.Fatalf("%s: %d stamps, %d distinct; repeated: %s", what, n, len(seen), strings.Join(dups, ", "))
}
