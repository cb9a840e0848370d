package relay

import (
	"strconv"
	"strings"
)

// SQL for REQ and COUNT. Every client value is a bind parameter; the SQL text depends only on the
// filter's shape, so pgx's statement cache sees few distinct texts. Single values compile to "=",
// not "= ANY": PostgreSQL (before 17) returns ordered index scans only for plain equality, which is
// what makes `authors:[x], limit:100` a short walk of events_pubkey_idx instead of a sort.
//
// Tag conditions (#x) read buzz.event_tags, a B-tree on (tagval, created_at DESC, event_id). A
// filter with tags and no ids walks one tag's entries in that order (the driver, t0) and joins
// each to its event by id alone, ordered by the walk's own columns: joined on created_at too, the
// planner multiplies the two join selectivities, expects about one row, and sorts every match
// instead of walking (docs/benchmarks.md). The other tag conditions are probes of the same index
// at the driver's (created_at, event_id).

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

// eventRef names an event's (created_at, id) in a query: the events row itself, or the driver's
// entry in buzz.event_tags (equal by construction, and in the walk's order).
type eventRef struct{ createdAt, id string }

var (
	eventRow = eventRef{"e.created_at", "e.id"}
	driverAt = eventRef{"t0.created_at", "t0.event_id"}
)

// driver is the tag condition whose index entries a REQ or COUNT of cf walks, or -1 when cf has
// no tag condition or names ids (a primary-key lookup drives then). The one with the fewest
// values: a single value walks in order; several need one walk each.
func (cf *compiledFilter) driver() int {
	if cf.ids != nil || len(cf.tags) == 0 {
		return -1
	}
	best := 0
	for i, tc := range cf.tags {
		if len(tc.tagvals) < len(cf.tags[best].tagvals) {
			best = i
		}
	}
	return best
}

// tagValuesSQL is the condition "col is one of vals".
func tagValuesSQL(a *sqlArgs, col string, vals []string) string {
	if len(vals) == 1 {
		return col + " = " + a.add(vals[0])
	}
	return col + " = ANY(" + a.add(vals) + "::text[])"
}

// tagProbeSQL: the event at ref carries one of tc's keys. The index's unique key finds it.
func tagProbeSQL(a *sqlArgs, tc tagCond, alias string, ref eventRef) string {
	return `EXISTS (SELECT 1 FROM buzz.event_tags ` + alias + ` WHERE ` + tagValuesSQL(a, alias+".tagval", tc.tagvals) +
		` AND ` + alias + `.created_at = ` + ref.createdAt + ` AND ` + alias + `.event_id = ` + ref.id + `)`
}

// whereSQL is the WHERE clause of one filter: its conditions but the driver's tag condition (skip;
// -1 for none), expiry and the gate. ref is where since, until and the tag probes look.
func (cf *compiledFilter) whereSQL(a *sqlArgs, gate string, skip int, ref eventRef) string {
	var b strings.Builder
	cond := func(s string) {
		if b.Len() > 0 {
			b.WriteString(" AND ")
		}
		b.WriteString(s)
	}
	if cf.ids != nil {
		cond(tagValuesSQL(a, "e.id", cf.ids))
	}
	if cf.authors != nil {
		cond(tagValuesSQL(a, "e.pubkey", cf.authors))
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
	for i, tc := range cf.tags {
		if i != skip {
			cond(tagProbeSQL(a, tc, "t"+strconv.Itoa(i+1), ref))
		}
	}
	if cf.since != nil {
		cond(ref.createdAt + " >= " + a.add(*cf.since) + "::bigint")
	}
	if cf.until != nil {
		cond(ref.createdAt + " <= " + a.add(*cf.until) + "::bigint")
	}
	cond("(e.expires_at IS NULL OR e.expires_at > " + sqlNow + ")")
	cond(gate)
	return b.String()
}

// reqPartSQL is the initial query of one filter: its newest limit rows, ties by lowest id.
func (cf *compiledFilter) reqPartSQL(a *sqlArgs, gate string) string {
	limit := ` LIMIT ` + strconv.Itoa(cf.limit)
	d := cf.driver()
	if d < 0 {
		return `SELECT ` + selectCols + ` FROM buzz.events e WHERE ` + cf.whereSQL(a, gate, -1, eventRow) +
			` ORDER BY e.created_at DESC, e.id` + limit
	}
	walk := func(key string) string {
		return `SELECT ` + selectCols + ` FROM buzz.event_tags t0 JOIN buzz.events e ON e.id = t0.event_id` +
			` WHERE t0.tagval = ` + key + ` AND ` + cf.whereSQL(a, gate, d, driverAt) +
			` ORDER BY t0.created_at DESC, t0.event_id` + limit
	}
	vals := cf.tags[d].tagvals
	if len(vals) == 1 {
		return walk(a.add(vals[0]))
	}
	// One ordered walk per value, each cut at the limit; an event with several of the values
	// comes out of several walks, next to itself, and DISTINCT ON keeps one.
	return `SELECT DISTINCT ON (x.created_at, x.id) x.* FROM unnest(` + a.add(vals) + `::text[]) v(tagval)` +
		` CROSS JOIN LATERAL (` + walk(`v.tagval`) + `) x ORDER BY x.created_at DESC, x.id` + limit
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
		parts = append(parts, cf.reqPartSQL(a, gate))
	}
	switch len(parts) {
	case 0:
		return "", nil
	case 1:
		return parts[0], a.vals
	}
	return `SELECT * FROM ((` + strings.Join(parts, `) UNION ALL (`) + `)) u ORDER BY u.created_at DESC, u.id`, a.vals
}

// countFromSQL is the FROM and WHERE of one filter's COUNT: every matching event once (e.id). A
// single-value driver has one entry per event, each looked up by primary key: OFFSET 0 keeps the
// lookup a per-entry probe, which the planner otherwise traded for a hash join over every event
// (27 ms against 8 on 20,000 events, docs/benchmarks.md). Several values: the distinct ids.
func (cf *compiledFilter) countFromSQL(a *sqlArgs, gate string) string {
	d := cf.driver()
	if d < 0 {
		return `buzz.events e WHERE ` + cf.whereSQL(a, gate, -1, eventRow)
	}
	vals := cf.tags[d].tagvals
	if len(vals) == 1 {
		key := a.add(vals[0])
		return `buzz.event_tags t0 CROSS JOIN LATERAL (SELECT e.id FROM buzz.events e WHERE e.id = t0.event_id AND ` +
			cf.whereSQL(a, gate, d, driverAt) + ` OFFSET 0) e WHERE t0.tagval = ` + key
	}
	return `buzz.events e WHERE e.id IN (SELECT t0.event_id FROM buzz.event_tags t0 WHERE t0.tagval = ANY(` +
		a.add(vals) + `::text[])) AND ` + cf.whereSQL(a, gate, d, eventRow)
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
		parts = append(parts, cf.countFromSQL(a, gate))
	}
	switch len(parts) {
	case 0:
		return "", nil
	case 1:
		return `SELECT count(*) FROM ` + parts[0], a.vals
	}
	return `SELECT count(*) FROM (SELECT e.id FROM ` + strings.Join(parts, ` UNION SELECT e.id FROM `) + `) u`, a.vals
}
