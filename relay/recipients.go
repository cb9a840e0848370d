package relay

import (
	"cmp"
	"slices"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// Connections by authenticated pubkey, so that an event only some pubkeys may read (a viewer's
// snapshot, a gift wrap, a DM, a reminder) costs a look at their connections, not a walk over every
// connection this process holds: with thousands of viewers connected, that walk ran once per
// snapshot and made convergence grow with the number of connections. Guarded by Server.mu, like
// Server.conns; every entry is a connection in Server.conns.
type authIndex map[string]map[*conn]struct{}

// indexAuth records that c authenticated as pubkey, unless c is already gone (removeConn ran
// first and found nothing to remove). The caller has put pubkey in c.authed beforehand, so a
// removeConn that runs after this finds the entry and takes it out.
func (s *Server) indexAuth(c *conn, pubkey string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, open := s.conns[c]; !open {
		return
	}
	set := s.byPubkey[pubkey]
	if set == nil {
		set = map[*conn]struct{}{}
		s.byPubkey[pubkey] = set
	}
	set[c] = struct{}{}
}

// unindexAuth takes c out of the index; s.mu is held.
func (s *Server) unindexAuth(c *conn) {
	for _, pk := range c.authedList() {
		if set := s.byPubkey[pk]; set != nil {
			delete(set, c)
			if len(set) == 0 {
				delete(s.byPubkey, pk)
			}
		}
	}
}

// recipients returns the connections that may read d: for a public event those with a filter
// that could match it (interest.candidates), else those authenticated as a pubkey its scope names
// (members: the DM's sorted member set). It is a superset at worst; Scope.Readable and the
// filters still decide for each.
func (s *Server) recipients(d evt.Delivery, members []string) []*conn {
	switch d.Scope.Kind {
	case evt.ScopePublic:
		return s.interest.candidates(d.Event)
	case evt.ScopeAuthor:
		return s.connsOf([]string{d.Event.PubKey})
	case evt.ScopeP:
		return s.connsOf([]string{d.Scope.P})
	case evt.ScopeChannel:
		return s.connsOf(members)
	}
	return nil
}

// connsOf returns the connections authenticated as any of pubkeys, each once.
func (s *Server) connsOf(pubkeys []string) []*conn {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*conn
	add := func(set map[*conn]struct{}) {
		for c := range set {
			out = append(out, c)
		}
	}
	hits := 0
	if len(pubkeys) <= len(s.byPubkey) {
		for _, pk := range pubkeys {
			if set := s.byPubkey[pk]; set != nil {
				add(set)
				hits++
			}
		}
	} else {
		// A large member set and few authenticated pubkeys here: walk the smaller side.
		for pk, set := range s.byPubkey {
			if _, ok := slices.BinarySearch(pubkeys, pk); ok {
				add(set)
				hits++
			}
		}
	}
	if hits > 1 {
		// One connection may be authenticated as several of them.
		slices.SortFunc(out, func(a, b *conn) int { return cmp.Compare(a.id, b.id) })
		out = slices.CompactFunc(out, func(a, b *conn) bool { return a == b })
	}
	return out
}
