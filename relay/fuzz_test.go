package relay

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mailru/easyjson"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// FuzzParseMessage: the client-message parser never panics, and an EVENT it accepts survives a
// round trip through the relay's own encoding unchanged (what is verified is what is stored).
func FuzzParseMessage(f *testing.F) {
	sk := "0000000000000000000000000000000000000000000000000000000000000001"
	ev := signed(sk, 1, "hello \"world\" \u2603", 1700000000, nostr.Tag{"t", "x"}, nostr.Tag{"e", strings.Repeat("a", 64), "wss://r"})
	evJSON, _ := json.Marshal([]any{"EVENT", ev})
	f.Add(evJSON)
	f.Add([]byte(`["REQ","sub",{"kinds":[1],"authors":["` + ev.PubKey + `"],"#t":["x"],"since":1,"until":2,"limit":10}]`))
	f.Add([]byte(`["COUNT","c",{"ids":["` + ev.ID + `"]},{"#e":[]}]`))
	f.Add([]byte(`["CLOSE","sub"]`))
	f.Add([]byte(`["AUTH",{"id":"x"}]`))
	f.Add([]byte(`["EVENT",{"id":1}]`))
	f.Add([]byte(`[`))
	f.Fuzz(func(t *testing.T, data []byte) {
		m, perr := parseClientMessage(data)
		if perr != nil {
			if m != nil {
				t.Fatal("message and error")
			}
			return
		}
		switch m.verb {
		case verbEVENT, verbAUTH:
			if m.event == nil {
				t.Fatal("EVENT without event")
			}
			again, perr := parseClientMessage([]byte(`["EVENT",` + string(eventJSON(m.event)) + `]`))
			if perr != nil {
				t.Fatalf("re-encoded event does not parse: %s", perr.msg)
			}
			a, b := m.event, again.event
			if a.ID != b.ID || a.PubKey != b.PubKey || a.CreatedAt != b.CreatedAt || a.Kind != b.Kind ||
				a.Content != b.Content || a.Sig != b.Sig || !slices.EqualFunc(a.Tags, b.Tags, func(x, y nostr.Tag) bool { return slices.Equal(x, y) }) {
				t.Fatalf("round trip changed the event:\n%+v\n%+v", a, b)
			}
			// The checks must not panic on anything the parser lets through.
			_ = checkShapeAndSignature(m.event)
		case verbREQ, verbCOUNT:
			if m.subID == "" || len(m.filters) == 0 {
				t.Fatal("REQ without id or filters")
			}
			for _, f := range m.filters {
				if cf, err := compileFilter(f, filterLimits{maxLimit: 5000, defaultLimit: 500}); err == nil {
					reqSQL([]*compiledFilter{cf}, nil)
				}
			}
		case verbCLOSE:
			if m.subID == "" {
				t.Fatal("CLOSE without id")
			}
		default:
			t.Fatalf("unknown verb %d", m.verb)
		}
	})
}

// Deterministic keys and events for FuzzCompileFilter, so corpus entries can name them.
const (
	fuzzSK1 = "0000000000000000000000000000000000000000000000000000000000000002"
	fuzzSK2 = "0000000000000000000000000000000000000000000000000000000000000003"
)

func fuzzEvents() []nostr.Event {
	var out []nostr.Event
	for i, sk := range []string{fuzzSK1, fuzzSK2} {
		for j, k := range []int{1, 7, 30023, 10002} {
			ts := nostr.Timestamp(1600000000 + i*10 + j)
			tags := []nostr.Tag{{"t", "fz" + strconv.Itoa(j)}, {"e", strings.Repeat(strconv.Itoa(j), 64)}}
			if k == 30023 {
				tags = append(tags, nostr.Tag{"d", "art" + strconv.Itoa(i)})
			}
			if j%2 == 0 {
				tags = append(tags, nostr.Tag{"Z", "big"}, nostr.Tag{"p", strings.Repeat("b", 64)})
			}
			out = append(out, signed(sk, k, "fuzz "+strconv.Itoa(i*10+j), ts, tags...))
		}
	}
	return out
}

var placeholder = regexp.MustCompile(`\$(\d+)`)

// FuzzCompileFilter: any filter either is refused with a reason, or compiles to SQL that binds
// every client value as a parameter, runs on PostgreSQL, and agrees with the Go matcher used for
// live delivery: every row SQL returns matches in Go (soundness), and every fixed event that
// matches in Go is returned when the limit did not cut the answer (completeness).
func FuzzCompileFilter(f *testing.F) {
	pool := testenv.Pool(f, testenv.DB(f))
	fixed := fuzzEvents()
	for _, ev := range fixed {
		ok, msg, err := store.AcceptJSON(context.Background(), pool, eventJSON(&ev))
		if err != nil || !ok {
			f.Fatalf("store fixture: %v %s", err, msg)
		}
	}
	pk1, _ := nostr.GetPublicKey(fuzzSK1)
	f.Add([]byte(`{"kinds":[1,7],"authors":["` + pk1 + `"]}`))
	f.Add([]byte(`{"#t":["fz0","fz2"],"#Z":["big"],"since":1600000000,"until":1600000020,"limit":3}`))
	f.Add([]byte(`{"ids":["` + fixed[3].ID + `","` + fixed[4].ID + `"],"#e":["` + strings.Repeat("3", 64) + `"]}`))
	f.Add([]byte(`{"#d":["art1"],"limit":0}`))
	f.Add([]byte(`{"#p":["it's; DROP TABLE buzz.events; --"],"#q":[""]}`))
	f.Add([]byte(`{"kinds":[],"#t":[]}`))
	f.Add([]byte(`{"search":"x"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var flt nostr.Filter
		if err := easyjson.Unmarshal(data, &flt); err != nil {
			return
		}
		cf, err := compileFilter(flt, filterLimits{maxLimit: 50, defaultLimit: 20})
		if err != nil {
			if _, ok := err.(filterError); !ok {
				t.Fatalf("error of type %T", err)
			}
			return
		}
		for _, authed := range [][]string{nil, {pk1}} {
			sql, args := reqSQL([]*compiledFilter{cf}, authed)
			countQ, countArgs := countSQL([]*compiledFilter{cf}, authed)
			if cf.none && countQ != "" {
				t.Fatal("filter that matches nothing compiled to a COUNT query")
			}
			for _, q := range []struct {
				sql  string
				args []any
			}{{sql, args}, {countQ, countArgs}} {
				checkParameterised(t, q.sql, q.args)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var got []nostr.Event
			if sql != "" {
				rows, err := pool.Query(ctx, sql, args...)
				if err != nil {
					t.Fatalf("query failed: %v\n%s", err, sql)
				}
				for rows.Next() {
					var ev nostr.Event
					var kind int32
					var created int64
					var tags string
					if err := rows.Scan(&ev.ID, &ev.PubKey, &created, &kind, &tags, &ev.Content, &ev.Sig); err != nil {
						t.Fatal(err)
					}
					ev.Kind, ev.CreatedAt = int(kind), nostr.Timestamp(created)
					if err := json.Unmarshal([]byte(tags), &ev.Tags); err != nil {
						t.Fatal(err)
					}
					if !cf.matchesIndexed(&ev, nil, false) {
						t.Fatalf("SQL returned %s which the Go matcher rejects\n%s %v", ev.ID, sql, args)
					}
					got = append(got, ev)
				}
				if err := rows.Err(); err != nil {
					t.Fatalf("query failed: %v\n%s", err, sql)
				}
			}
			if len(got) < cf.limit {
				for _, ev := range fixed {
					if cf.matchesIndexed(&ev, nil, false) && !slices.ContainsFunc(got, func(g nostr.Event) bool { return g.ID == ev.ID }) {
						t.Fatalf("Go matches %s but SQL did not return it\n%s %v", ev.ID, sql, args)
					}
				}
			}
			if countQ != "" {
				var n int64
				if err := pool.QueryRow(ctx, countQ, countArgs...).Scan(&n); err != nil {
					t.Fatalf("count failed: %v\n%s", err, countQ)
				}
				if n < int64(len(got)) {
					t.Fatalf("COUNT %d < %d rows", n, len(got))
				}
			}
		}
	})
}

// checkParameterised: the SQL text holds no client data (only the relay's fixed literals), and
// every placeholder has exactly one argument.
func checkParameterised(t *testing.T, sql string, args []any) {
	t.Helper()
	if sql == "" {
		return
	}
	stripped := sql
	for _, lit := range []string{`'*'`, `'a'`, `'p'`, `'c'`} {
		stripped = strings.ReplaceAll(stripped, lit, "")
	}
	if strings.ContainsAny(stripped, `'";`) {
		t.Fatalf("SQL text carries a literal: %s", sql)
	}
	maxN := 0
	for _, m := range placeholder.FindAllStringSubmatch(sql, -1) {
		n, _ := strconv.Atoi(m[1])
		maxN = max(maxN, n)
	}
	if maxN != len(args) {
		t.Fatalf("%d placeholders, %d args: %s", maxN, len(args), sql)
	}
}
