package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// fillEvents inserts n synthetic public events straight into buzz.events (signatures are not
// checked on reads, so setup need not sign 100,000 events): 100 authors, kinds 1 and 7, a t tag
// per row out of 50 and an e tag, created_at one second apart.
func fillEvents(t testing.TB, pool *pgxpool.Pool, n int) (author string) {
	t.Helper()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
		INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, tagvals)
		SELECT encode(sha256(('ev' || i)::bytea), 'hex'),
		       encode(sha256(('pk' || (i % 100))::bytea), 'hex'),
		       1600000000 + i,
		       CASE WHEN i % 10 = 0 THEN 7 ELSE 1 END,
		       jsonb_build_array(jsonb_build_array('t', 'tag' || (i % 50)),
		                         jsonb_build_array('e', encode(sha256(('ref' || (i % 1000))::bytea), 'hex'))),
		       'synthetic event number ' || i,
		       repeat('0', 128),
		       ARRAY['t:tag' || (i % 50), 'e:' || encode(sha256(('ref' || (i % 1000))::bytea), 'hex')]
		FROM generate_series(1, $1) i`, n)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE buzz.events, buzz.event_tags`); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT encode(sha256('pk7'::bytea), 'hex')`).Scan(&author); err != nil {
		t.Fatal(err)
	}
	return author
}

// BenchmarkReqLatency measures REQ→EOSE for a limit-100 query over 100,000 stored events through
// the relay (one client, one query at a time), beside the same SELECT run directly with pgx on the
// same database in the same run (concurrency 1). Reported: relay_ns/op, pgx_ns/op and their ratio.
func BenchmarkReqLatency(b *testing.B) {
	dbURL := testenv.FreshDB(b)
	tr := startRelayOn(b, dbURL, nil)
	fillEvents(b, tr.pool, 100_000)
	c := tr.dial(b)
	filter := nostr.Filter{Kinds: []int{1}, Limit: 100}

	cf, err := compileFilter(filter, filterLimits{maxLimit: 5000, defaultLimit: 500})
	if err != nil {
		b.Fatal(err)
	}
	sql, args := reqSQL([]*compiledFilter{cf}, nil)
	baseline := func() int {
		rows, err := tr.s.query.Query(context.Background(), sql, args...)
		if err != nil {
			b.Fatal(err)
		}
		n := 0
		for rows.Next() {
			var id, pk, tags, content, sig string
			var created int64
			var kind int32
			if err := rows.Scan(&id, &pk, &created, &kind, &tags, &content, &sig); err != nil {
				b.Fatal(err)
			}
			n++
		}
		if rows.Err() != nil {
			b.Fatal(rows.Err())
		}
		return n
	}
	// Warm both paths (plan cache, buffers).
	if got := c.req("w", filter); len(got) != 100 {
		b.Fatalf("warm-up got %d", len(got))
	}
	if baseline() != 100 {
		b.Fatal("baseline rows")
	}
	// The client only frames and counts, like the baseline only scans: decoding 100 events in the
	// test client would be client cost, not relay cost.
	reqMsg, _ := json.Marshal([]any{"REQ", "s", filter})
	relayReq := func() int {
		c.sendRaw(reqMsg)
		n := 0
		for {
			_ = c.ws.SetReadDeadline(time.Now().Add(readTimeout))
			_, msg, err := c.ws.ReadMessage()
			if err != nil {
				b.Fatal(err)
			}
			switch {
			case bytes.HasPrefix(msg, []byte(`["EVENT","s",`)):
				n++
			case bytes.HasPrefix(msg, []byte(`["EOSE","s"]`)):
				return n
			default:
				b.Fatalf("unexpected %s", msg)
			}
		}
	}
	var relayTotal, pgxTotal time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		got := relayReq()
		relayTotal += time.Since(start)
		if got != 100 {
			b.Fatalf("got %d events", got)
		}
		start = time.Now()
		baseline()
		pgxTotal += time.Since(start)
	}
	b.StopTimer()
	relayNs := float64(relayTotal.Nanoseconds()) / float64(b.N)
	pgxNs := float64(pgxTotal.Nanoseconds()) / float64(b.N)
	b.ReportMetric(relayNs, "relay_ns/op")
	b.ReportMetric(pgxNs, "pgx_ns/op")
	b.ReportMetric(relayNs/pgxNs, "relay/pgx")
}

// TestQueryPlans asserts with EXPLAIN that the filter shapes clients send most use an index on
// buzz.events (no sequential scan of the table), public and with the gate for an authenticated
// connection.
func TestQueryPlans(t *testing.T) {
	dbURL := testenv.FreshDB(t)
	pool := testenv.Pool(t, dbURL)
	author := fillEvents(t, pool, 50_000)
	ref := strings.Repeat("a", 64)
	shapes := map[string]nostr.Filter{
		"ids":             {IDs: []string{ref, strings.Repeat("b", 64)}},
		"one author":      {Authors: []string{author}, Limit: 100},
		"author+kind":     {Authors: []string{author}, Kinds: []int{7}, Limit: 100},
		"one kind":        {Kinds: []int{7}, Limit: 100},
		"#t":              {Tags: nostr.TagMap{"t": {"tag3"}}, Limit: 100},
		"#e":              {Tags: nostr.TagMap{"e": {ref}}},
		"#t+kind":         {Tags: nostr.TagMap{"t": {"tag3"}}, Kinds: []int{1}, Limit: 100},
		"#t two values":   {Tags: nostr.TagMap{"t": {"tag3", "tag4"}}, Limit: 100},
		"#t and #e":       {Tags: nostr.TagMap{"t": {"tag3"}, "e": {ref}}, Limit: 100},
		"kind+since":      {Kinds: []int{1}, Since: ts(1600049000), Limit: 50},
		"recent, no kind": {Since: ts(1600049900), Limit: 50},
	}
	for name, f := range shapes {
		cf, err := compileFilter(f, filterLimits{maxLimit: 5000, defaultLimit: 500})
		if err != nil {
			t.Fatal(err)
		}
		for _, authed := range [][]string{nil, {author}} {
			sql, args := reqSQL([]*compiledFilter{cf}, authed)
			rows, err := pool.Query(context.Background(), `EXPLAIN `+sql, args...)
			if err != nil {
				t.Fatal(err)
			}
			var lines []string
			for rows.Next() {
				var l string
				_ = rows.Scan(&l)
				lines = append(lines, l)
			}
			rows.Close()
			text := strings.Join(lines, "\n")
			if strings.Contains(text, "Seq Scan on events") || !strings.Contains(text, "Index") {
				t.Errorf("%s (authed=%v): no index use:\n%s", name, len(authed) > 0, text)
			}
			// One tag value and a limit: a walk of buzz.event_tags in the REQ's order, no sort.
			if (name == "#t" || name == "#t+kind") && strings.Contains(text, "Sort") {
				t.Errorf("%s (authed=%v): sorts instead of walking event_tags_idx:\n%s", name, len(authed) > 0, text)
			}
		}
	}
}
