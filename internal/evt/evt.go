// Package evt holds the types both Go sides share: an event on its way to connections, and the
// read scope that decides who may see it. The scope is computed once, in SQL, by buzz.accept_event
// (columns scope / scope_p / channel_id of buzz.events) and travels with the event, so the relay's
// live gate and the SQL gate of REQ/COUNT judge from the same facts.
package evt

import "github.com/nbd-wtf/go-nostr"

// ScopeKind is the read gate class of an event (docs/protocol.md, Read gates).
type ScopeKind byte

const (
	ScopePublic  ScopeKind = '*' // everyone
	ScopeAuthor  ScopeKind = 'a' // only the event's author (commands 41010-41012, 30300, gated deletions)
	ScopeP       ScopeKind = 'p' // only the pubkey in Scope.P (30622 viewer, 1059 recipient)
	ScopeChannel ScopeKind = 'c' // only members of Scope.Channel (events with an h tag naming a DM)
)

// Scope says who may read an event.
type Scope struct {
	Kind    ScopeKind
	P       string // hex pubkey for ScopeP
	Channel string // channel uuid for ScopeChannel
}

// MemberFunc reports whether pubkey is a member of channel. DM participant sets never change
// through the protocol; an operator's edit of member rows is announced (Sink.MembersChanged), so
// implementations may cache sets until then.
type MemberFunc func(channel, pubkey string) bool

// Readable reports whether a connection authenticated as any of authed may read an event with
// this scope and author. A scope it does not know, the zero one included, is readable by nobody.
func (s Scope) Readable(author string, authed []string, isMember MemberFunc) bool {
	switch s.Kind {
	case ScopePublic:
		return true
	case ScopeAuthor:
		return contains(authed, author)
	case ScopeP:
		return contains(authed, s.P)
	case ScopeChannel:
		for _, a := range authed {
			if isMember(s.Channel, a) {
				return true
			}
		}
		return false
	}
	return false
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Delivery is one event on its way to live subscriptions: a stored one (logical replication of
// buzz.events inserts) or an ephemeral one (a transactional logical message).
type Delivery struct {
	Event *nostr.Event
	Scope Scope
	// Xid is the committing transaction's id (its low 32 bits, as logical decoding gives it; 0 if
	// unknown). A subscription's initial query answered or passed over every event whose
	// transaction its snapshot saw, so those are not delivered to it live.
	Xid uint32
	// CommitLSN is where the transaction's commit record is (0 if unknown). Deliveries come in
	// commit order, so once one is past a REQ snapshot's WAL position, none after it was seen.
	CommitLSN uint64
}

// Due is a NIP-ER due signal: a reminder (kind 30300) sent again to its author's live
// subscriptions when it comes due. It matches filters ignoring since/until, and a connection gets
// it once per (event id, Stamp), however often it saw the event before.
type Due struct {
	Event *nostr.Event
	Stamp int64
	// CommitLSN is where the confirming transaction's commit record is, as for Delivery.
	CommitLSN uint64
}

// MembersChange names the channels whose member rows changed (an operator's edit,
// sql/0005_fanout), or All of them (a TRUNCATE): cached member sets of them must be forgotten.
type MembersChange struct {
	Channels []string
	All      bool
	Xid      uint32 // the transaction that changed them (0 if unknown)
}

// Sink receives what the replication stream hands over, in commit order; the relay implements it.
type Sink interface {
	// DeliverEvent hands over a stored or ephemeral event.
	DeliverEvent(d Delivery)
	// DeliverDue hands over a reminder's due signal.
	DeliverDue(d Due)
	// MembersChanged says member rows changed.
	MembersChanged(c MembersChange)
	// StreamRestarted says the stream restarted on a new slot: announcements sent meanwhile were
	// lost (every cached member set is suspect), and transaction ids and WAL positions from before
	// it say nothing about what comes next.
	StreamRestarted()
}
