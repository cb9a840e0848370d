package relay

import (
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/nbd-wtf/go-nostr"
)

// compiledFilter is a validated NIP-01 filter, ready for SQL (filter_sql.go) and for matching live
// events (matchesIndexed). Both sides read the same fields, so the initial query and live
// delivery agree on what a filter means.
type compiledFilter struct {
	ids     []string // nil: any
	authors []string // nil: any
	kinds   []int    // nil: any
	tags    []tagCond
	since   *int64
	until   *int64
	limit   int  // rows for the initial query; 0: none (limit:0 or a filter that matches nothing)
	none    bool // matches nothing at all (an empty list, or since > until)
}

type tagCond struct {
	letter  string
	values  []string
	tagvals []string // "x:value", the form of buzz.events.tagvals
}

// filterError is a filter the relay refuses; its text follows "invalid: ".
type filterError string

func (e filterError) Error() string { return string(e) }

type filterLimits struct {
	maxLimit, defaultLimit int
}

// compileFilter validates f. Lists are exact-match: ids and authors must be 64-character lowercase
// hex (NIP-01), kinds 0-65535, tag filters single letters. An empty list matches nothing.
func compileFilter(f nostr.Filter, lim filterLimits) (*compiledFilter, error) {
	cf := &compiledFilter{}
	if f.Search != "" {
		return nil, filterError("search (NIP-50) is not supported")
	}
	var err error
	if cf.ids, err = hexList("ids", f.IDs); err != nil {
		return nil, err
	}
	if cf.authors, err = hexList("authors", f.Authors); err != nil {
		return nil, err
	}
	if cf.kinds, err = kindList(f.Kinds); err != nil {
		return nil, err
	}
	if cf.tags, err = tagConds(f.Tags); err != nil {
		return nil, err
	}
	if f.Since != nil {
		v := int64(*f.Since)
		cf.since = &v
	}
	if f.Until != nil {
		v := int64(*f.Until)
		cf.until = &v
	}
	cf.none = cf.matchesNothing()
	if cf.limit, err = rowLimit(f, cf, lim); err != nil {
		return nil, err
	}
	return cf, nil
}

// matchesNothing reports whether no event can match: an empty list, or since after until.
func (cf *compiledFilter) matchesNothing() bool {
	if cf.ids != nil && len(cf.ids) == 0 || cf.authors != nil && len(cf.authors) == 0 || cf.kinds != nil && len(cf.kinds) == 0 {
		return true
	}
	for _, tc := range cf.tags {
		if len(tc.values) == 0 {
			return true
		}
	}
	return cf.since != nil && cf.until != nil && *cf.since > *cf.until
}

// rowLimit is how many rows the initial query of cf returns: 0 for none (limit 0, or a filter
// that matches nothing), the default when f names none, at most the relay's maximum.
func rowLimit(f nostr.Filter, cf *compiledFilter, lim filterLimits) (int, error) {
	limit := 0
	switch {
	case f.Limit < 0:
		return 0, filterError("limit must not be negative")
	case f.LimitZero || cf.none:
		limit = 0
	case f.Limit == 0:
		limit = lim.defaultLimit
	case f.Limit > lim.maxLimit:
		limit = lim.maxLimit
	default:
		limit = f.Limit
	}
	if cf.ids != nil && limit > len(cf.ids) {
		limit = len(cf.ids) // ids are unique: no more rows than ids
	}
	return limit, nil
}

// kindList validates, sorts and de-duplicates kinds (nil: any kind).
func kindList(kinds []int) ([]int, error) {
	if kinds == nil {
		return nil, nil
	}
	if len(kinds) > maxFilterValues {
		return nil, filterError(fmt.Sprintf("too many kinds in a filter (max %d)", maxFilterValues))
	}
	out := make([]int, 0, len(kinds))
	for _, k := range kinds {
		if k < 0 || k > 65535 {
			return nil, filterError("kinds must be between 0 and 65535")
		}
		out = append(out, k)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// tagConds validates the tag filters, in letter order: deterministic SQL text, so prepared
// statements are reused.
func tagConds(tags nostr.TagMap) ([]tagCond, error) {
	letters := make([]string, 0, len(tags))
	for k := range tags {
		letters = append(letters, k)
	}
	slices.Sort(letters)
	var out []tagCond
	for _, letter := range letters {
		tc, err := compileTagCond(letter, tags[letter])
		if err != nil {
			return nil, err
		}
		out = append(out, tc)
	}
	return out, nil
}

func compileTagCond(letter string, vals []string) (tagCond, error) {
	if len(letter) != 1 || !(letter[0] >= 'a' && letter[0] <= 'z' || letter[0] >= 'A' && letter[0] <= 'Z') {
		return tagCond{}, filterError("only single-letter tag filters (#a-#z, #A-#Z) are supported")
	}
	if len(vals) > maxFilterValues {
		return tagCond{}, filterError(fmt.Sprintf("too many values for #%s (max %d)", letter, maxFilterValues))
	}
	tc := tagCond{letter: letter}
	for _, v := range vals {
		if strings.IndexByte(v, 0) >= 0 || !utf8.ValidString(v) {
			return tagCond{}, filterError("tag values must be valid UTF-8 without NUL")
		}
		tc.values = append(tc.values, v)
	}
	// Sorted: live matching binary-searches them (a linear scan made an event with many tags
	// cost tags × values per filter on the one fan-out goroutine).
	slices.Sort(tc.values)
	tc.values = slices.Compact(tc.values)
	for _, v := range tc.values {
		tc.tagvals = append(tc.tagvals, letter+":"+v)
	}
	return tc, nil
}

func hexList(name string, vals []string) ([]string, error) {
	if vals == nil {
		return nil, nil
	}
	if len(vals) > maxFilterValues {
		return nil, filterError(fmt.Sprintf("too many %s in a filter (max %d)", name, maxFilterValues))
	}
	out := make([]string, 0, len(vals))
	for _, v := range vals {
		if !isHex(v, 64) {
			return nil, filterError(name + " must be 64-character lowercase hex")
		}
		out = append(out, v)
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}

// tag returns the values of the #letter condition, or nil when the filter has none.
func (cf *compiledFilter) tag(letter string) []string {
	for _, t := range cf.tags {
		if t.letter == letter {
			return t.values
		}
	}
	return nil
}

func (cf *compiledFilter) hasTag(letter string) bool {
	for _, t := range cf.tags {
		if t.letter == letter {
			return true
		}
	}
	return false
}

// values counts the listed values, what a connection's filters may hold in total
// (maxConnFilterValues).
func (cf *compiledFilter) values() int {
	n := len(cf.ids) + len(cf.authors) + len(cf.kinds)
	for _, tc := range cf.tags {
		n += len(tc.values)
	}
	return n
}

// matchesIndexed reports whether ev matches, with ev's tags indexed (newTagIndex; nil for few
// tags); ignoreTime skips since/until (NIP-ER due signals).
func (cf *compiledFilter) matchesIndexed(ev *nostr.Event, ix tagIndex, ignoreTime bool) bool {
	if cf.none {
		return false
	}
	if cf.ids != nil && !sortedContains(cf.ids, ev.ID) {
		return false
	}
	if cf.authors != nil && !sortedContains(cf.authors, ev.PubKey) {
		return false
	}
	if cf.kinds != nil {
		if _, ok := slices.BinarySearch(cf.kinds, ev.Kind); !ok {
			return false
		}
	}
	if !ignoreTime {
		if cf.since != nil && int64(ev.CreatedAt) < *cf.since {
			return false
		}
		if cf.until != nil && int64(ev.CreatedAt) > *cf.until {
			return false
		}
	}
	for _, tc := range cf.tags {
		if !eventHasTag(ev, ix, tc) {
			return false
		}
	}
	return true
}

func sortedContains(sorted []string, s string) bool {
	_, ok := slices.BinarySearch(sorted, s)
	return ok
}

// tagIndex holds an event's (letter, value) pairs of single-letter tags, built once per delivered
// event when it has many tags, so that a condition costs at most its own value count.
type tagIndex map[tagKey]struct{}

type tagKey struct {
	letter byte
	value  string
}

// indexTagsFrom: below this many tags a scan is as cheap as building the index.
const indexTagsFrom = 16

func newTagIndex(ev *nostr.Event) tagIndex {
	if len(ev.Tags) < indexTagsFrom {
		return nil
	}
	ix := make(tagIndex, len(ev.Tags))
	for _, t := range ev.Tags {
		if len(t) >= 2 && len(t[0]) == 1 {
			ix[tagKey{t[0][0], t[1]}] = struct{}{}
		}
	}
	return ix
}

// eventHasTag: each of the event's tags is looked up in the condition's sorted values, or, when
// the event is indexed and the condition has fewer values than the event has tags, each value in
// the index. Either way the cost is bounded by the smaller side, not their product.
func eventHasTag(ev *nostr.Event, ix tagIndex, tc tagCond) bool {
	if ix != nil && len(tc.values) < len(ev.Tags) {
		for _, v := range tc.values {
			if _, ok := ix[tagKey{tc.letter[0], v}]; ok {
				return true
			}
		}
		return false
	}
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == tc.letter && sortedContains(tc.values, t[1]) {
			return true
		}
	}
	return false
}

func (c *conn) compileFilters(filters []nostr.Filter) ([]*compiledFilter, error) {
	if len(filters) > c.s.cfg.MaxFilters {
		return nil, filterError(fmt.Sprintf("too many filters (max %d)", c.s.cfg.MaxFilters))
	}
	lim := filterLimits{maxLimit: c.s.cfg.MaxLimit, defaultLimit: c.s.cfg.DefaultLimit}
	out := make([]*compiledFilter, 0, len(filters))
	for _, f := range filters {
		cf, err := compileFilter(f, lim)
		if err != nil {
			return nil, err
		}
		out = append(out, cf)
	}
	return out, nil
}
