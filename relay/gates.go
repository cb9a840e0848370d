package relay

import (
	"context"
	"slices"

	"github.com/nbd-wtf/go-nostr"
)

// Kinds whose every row is gated, by gate class (docs/protocol.md, Read gates). Used only to
// decide from a filter's shape whether it can match anything readable; the authoritative gate is
// the SQL (gateSQL) and, for live events, evt.Scope computed by accept_event.
var (
	authorOnlyKinds = []int{30300, 41010, 41011, 41012}
	pGatedKinds     = []int{1059, 30622}
)

// gateClosure decides the closing rule (docs/protocol.md, Read gates) for one filter: "" when the
// filter can match rows this connection may read (it is answered with those, the rest silently
// omitted); otherwise the CLOSED reason: auth-required when not authenticated, restricted when
// authenticated as someone else. sets holds the member sets of the filter's h values (membersOf).
func gateClosure(cf *compiledFilter, authed []string, sets map[string][]string) string {
	if cf.none {
		return "" // matches nothing: an empty answer hides nothing
	}
	readable := true
	if cf.kinds != nil {
		readable = false
		for _, k := range cf.kinds {
			switch {
			case slices.Contains(authorOnlyKinds, k):
				readable = readable || intersects(cf.authors, authed)
			case slices.Contains(pGatedKinds, k):
				// Read by the one pubkey in the p tag: a relay-signed snapshot names one viewer,
				// and a gift wrap naming a second recipient is refused (checkEvent; accept_event
				// from psql since 0024). One stored before those checks is readable by its
				// first p only, so this can only close a filter the gate would have answered,
				// never serve more than the gate does.
				readable = readable || intersects(cf.tag("p"), authed)
			default:
				readable = true
			}
			if readable {
				break
			}
		}
	}
	if readable && cf.hasTag("h") {
		// Every stored h tag names the event's one DM (accept_event refuses others), so a filter
		// on h values none of which is a DM of an authenticated pubkey can only match gated rows.
		readable = anyMember(sets, cf.tag("h"), authed)
	}
	if readable {
		return ""
	}
	if len(authed) == 0 {
		return "auth-required: this filter only matches events readable after AUTH"
	}
	return "restricted: this filter only matches events you may not read"
}

// intersects reports whether list (nil meaning "any value") shares a value with authed.
func intersects(list, authed []string) bool {
	if len(authed) == 0 {
		return false
	}
	if list == nil {
		return true
	}
	for _, a := range authed {
		if slices.Contains(list, a) {
			return true
		}
	}
	return false
}

// checkGates applies the gate closing rule to every filter: one filter that can only match
// unreadable rows closes the whole REQ, so the client learns it should AUTH (a subscription
// cannot be half closed, and silently dropping part of it would leave the client waiting).
// The member sets of every h value in the request are read at once, on the query pool.
func (c *conn) checkGates(cfs []*compiledFilter) string {
	authed := c.authedList()
	var channels []string
	if len(authed) > 0 {
		for _, cf := range cfs {
			if !cf.none && cf.hasTag("h") {
				channels = append(channels, cf.tag("h")...)
			}
		}
	}
	var sets map[string][]string
	if len(channels) > 0 {
		ctx, cancel := context.WithTimeout(c.ctx, c.s.memberWait)
		var err error
		sets, err = c.lookupMembers(ctx, channels)
		cancel()
		if err != nil {
			c.log.Warn("membership lookup failed", "err", err)
			return "error: could not check channel membership"
		}
	}
	for _, cf := range cfs {
		if reason := gateClosure(cf, authed, sets); reason != "" {
			return reason
		}
	}
	return ""
}

// admitFilters is what REQ and COUNT both pass before any query: the rate limit, the filter
// compiler and the read gates. On refusal it has already answered CLOSED, and ended a REQ of the
// same id (closeID: a REQ has already replaced it, a COUNT's CLOSED reads as its end).
func (c *conn) admitFilters(verb, subID string, filters []nostr.Filter) ([]*compiledFilter, bool) {
	if !c.allowReq(verb) {
		c.closeID(subID, "rate-limited: too many requests, slow down")
		return nil, false
	}
	cfs, err := c.compileFilters(filters)
	if err != nil {
		c.closeID(subID, "invalid: "+err.Error())
		return nil, false
	}
	if reason := c.checkGates(cfs); reason != "" {
		c.closeID(subID, reason)
		return nil, false
	}
	return cfs, true
}
