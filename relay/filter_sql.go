package relay

import (
	"strconv"
	"strings"
)

// SQL for REQ and COUNT. Every client value is a bind parameter; the SQL text depends only on the
// filter's shape, so pgx's statement cache sees few distinct texts. Single values compile to "=",
// not "= ANY": PostgreSQL (before 17) returns ordered index scans only for plain equality, which is
// what makes `authors:[x], limit:100` a short walk of events_pubkey_idx instead of a sort.

// sqlNow is the database clock in unix seconds; NIP-40 expiry is judged by the same clock as
// acceptance.
const sqlNow = `floor(extract(epoch from statement_timestamp()))::bigint`

const selectCols = `e.id, e.pubkey, e.created_at, e.kind, e.tags::text AS tags, e.content, e.sig`

type sqlArgs struct{ vals []any }

func (a *sqlArgs) add(v any) string {
	a.vals = append(a.vals, v)
	return "$" + strconv.Itoa(len(a.vals))
}

// gateSQL is the read gate (docs/protocol.md, Read gates) for a connection authenticated as
// authed. Unauthenticated connections read only public rows, which keeps their plans simple.
func gateSQL(a *sqlArgs, authed []string) string {
	if len(authed) == 0 {
		return `e.scope = '*'`
	}
	p := a.add(authed)
	return `(e.scope = '*'` +
		` OR (e.scope = 'a' AND e.pubkey = ANY(` + p + `::text[]))` +
		` OR (e.scope = 'p' AND e.scope_p = ANY(` + p + `::text[]))` +
		` OR (e.scope = 'c' AND EXISTS (SELECT 1 FROM buzz.members m WHERE m.channel_id = e.channel_id AND m.pubkey = ANY(` + p + `::text[]))))`
}

// whereSQL is the WHERE clause of one filter: its conditions, expiry and the gate.
func (cf *compiledFilter) whereSQL(a *sqlArgs, gate string) string {
	var b strings.Builder
	cond := func(s string) {
		if b.Len() > 0 {
			b.WriteString(" AND ")
		}
		b.WriteString(s)
	}
	textIn := func(col string, vals []string) {
		if len(vals) == 1 {
			cond(col + " = " + a.add(vals[0]))
		} else {
			cond(col + " = ANY(" + a.add(vals) + "::text[])")
		}
	}
	if cf.ids != nil {
		textIn("e.id", cf.ids)
	}
	if cf.authors != nil {
		textIn("e.pubkey", cf.authors)
	}
	if cf.kinds != nil {
		if len(cf.kinds) == 1 {
			cond("e.kind = " + a.add(int32(cf.kinds[0])) + "::int")
		} else {
			ks := make([]int32, len(cf.kinds))
			for i, k := range cf.kinds {
				ks[i] = int32(k)
			}
			cond("e.kind = ANY(" + a.add(ks) + "::int[])")
		}
	}
	for _, tc := range cf.tags {
		cond("e.tagvals && " + a.add(tc.tagvals) + "::text[]")
	}
	if cf.since != nil {
		cond("e.created_at >= " + a.add(*cf.since) + "::bigint")
	}
	if cf.until != nil {
		cond("e.created_at <= " + a.add(*cf.until) + "::bigint")
	}
	cond("(e.expires_at IS NULL OR e.expires_at > " + sqlNow + ")")
	cond(gate)
	return b.String()
}

// reqSQL is the initial query of a REQ: newest first, ties by lowest id, each filter with its own
// limit; several filters are one round trip (UNION ALL, ordered outside). Duplicates across
// filters come out adjacent (same created_at and id), so the caller drops them by comparing with
// the previous row. Returns "" when no filter wants initial rows.
func reqSQL(filters []*compiledFilter, authed []string) (string, []any) {
	a := &sqlArgs{}
	gate := gateSQL(a, authed)
	var parts []string
	for _, cf := range filters {
		if cf.none || cf.limit <= 0 {
			continue
		}
		parts = append(parts, `SELECT `+selectCols+` FROM buzz.events e WHERE `+cf.whereSQL(a, gate)+
			` ORDER BY e.created_at DESC, e.id LIMIT `+strconv.Itoa(cf.limit))
	}
	switch len(parts) {
	case 0:
		return "", nil
	case 1:
		return parts[0], a.vals
	}
	return `SELECT * FROM ((` + strings.Join(parts, `) UNION ALL (`) + `)) u ORDER BY u.created_at DESC, u.id`, a.vals
}

// countSQL counts the distinct readable events matching any filter (NIP-45; limit is ignored).
func countSQL(filters []*compiledFilter, authed []string) (string, []any) {
	a := &sqlArgs{}
	gate := gateSQL(a, authed)
	var parts []string
	for _, cf := range filters {
		if cf.none {
			continue
		}
		parts = append(parts, `SELECT e.id FROM buzz.events e WHERE `+cf.whereSQL(a, gate))
	}
	switch len(parts) {
	case 0:
		return "", nil
	case 1:
		return `SELECT count(*) FROM buzz.events e WHERE ` + strings.TrimPrefix(parts[0], `SELECT e.id FROM buzz.events e WHERE `), a.vals
	}
	return `SELECT count(*) FROM (` + strings.Join(parts, ` UNION `) + `) u`, a.vals
}
