package fanout

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"strconv"

	"github.com/jackc/pglogrepl"
	"github.com/mailru/easyjson/jlexer"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// MessagePrefix is the prefix of the transactional logical messages SQL emits for what is not a
// stored row (pg_logical_emit_message(true, 'buzz', payload)).
const MessagePrefix = "buzz"

// relation remembers where the columns fan-out reads sit in a replicated table's tuples. pgoutput
// sends a Relation message before the first change of a table in every session (and again after
// DDL), so relations are per session and keyed by relation OID.
type relation struct {
	schema, table string
	// Positions of buzz.events' columns, -1 when the table has none of that name.
	id, pubkey, sig, content, createdAt, kind, tags, scope, scopeP, channelID int
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{schema: m.Namespace, table: m.RelationName}
	pos := func(name string) int {
		for i, c := range m.Columns {
			if c.Name == name {
				return i
			}
		}
		return -1
	}
	r.id, r.pubkey, r.sig, r.content = pos("id"), pos("pubkey"), pos("sig"), pos("content")
	r.createdAt, r.kind, r.tags = pos("created_at"), pos("kind"), pos("tags")
	r.scope, r.scopeP, r.channelID = pos("scope"), pos("scope_p"), pos("channel_id")
	return r
}

// column is one value of a pgoutput tuple: its text, or null when it has none (NULL, unchanged
// TOAST, which an INSERT never carries, or binary, which we never ask for). data points into the
// message, valid until the next one is read.
type column struct {
	null bool
	data []byte
}

// parseInsert reads a pgoutput Insert message ('I', relation OID, 'N', the new tuple) into cols,
// reusing its array, without copying a value: pglogrepl.Parse allocates every column and copies
// it byte by byte, for a row decodeRow copies once more into strings.
func parseInsert(data []byte, cols []column) (relID uint32, _ []column, err error) {
	bad := func(what string) (uint32, []column, error) {
		return 0, cols, fmt.Errorf("pgoutput insert: %s", what)
	}
	if len(data) < 8 || data[0] != byte(pglogrepl.MessageTypeInsert) || data[5] != 'N' {
		return bad("no new tuple")
	}
	relID = binary.BigEndian.Uint32(data[1:5])
	n, rest := int(binary.BigEndian.Uint16(data[6:8])), data[8:]
	cols = cols[:0]
	for range n {
		if len(rest) < 1 {
			return bad("short tuple")
		}
		kind := rest[0]
		rest = rest[1:]
		switch kind {
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			if len(rest) < 4 {
				return bad("short column length")
			}
			l := binary.BigEndian.Uint32(rest)
			if uint64(l) > uint64(len(rest)-4) {
				return bad("column longer than the message")
			}
			cols = append(cols, column{data: rest[4 : 4+l : 4+l], null: kind == pglogrepl.TupleDataTypeBinary})
			rest = rest[4+l:]
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
			cols = append(cols, column{null: true})
		default:
			return bad(fmt.Sprintf("column kind %q", kind))
		}
	}
	return relID, cols, nil
}

// decodeRow turns a buzz.events INSERT tuple (pgoutput text format) into a delivery.
func decodeRow(r *relation, cols []column) (evt.Delivery, error) {
	get := func(i int) (string, bool) {
		if i < 0 || i >= len(cols) || cols[i].null {
			return "", false
		}
		return string(cols[i].data), true
	}
	var ev nostr.Event
	var missing string
	need := func(i int, name string) string {
		v, ok := get(i)
		if !ok && missing == "" {
			missing = name
		}
		return v
	}
	ev.ID, ev.PubKey, ev.Sig = need(r.id, "id"), need(r.pubkey, "pubkey"), need(r.sig, "sig")
	ev.Content = need(r.content, "content")
	created, kind := need(r.createdAt, "created_at"), need(r.kind, "kind")
	if r.tags < 0 || r.tags >= len(cols) || cols[r.tags].null {
		missing = cmp.Or(missing, "tags")
	}
	if missing != "" {
		return evt.Delivery{}, fmt.Errorf("buzz.events row without %s", missing)
	}
	ca, err := strconv.ParseInt(created, 10, 64)
	if err != nil {
		return evt.Delivery{}, fmt.Errorf("created_at %q: %w", created, err)
	}
	ev.CreatedAt = nostr.Timestamp(ca)
	if ev.Kind, err = strconv.Atoi(kind); err != nil {
		return evt.Delivery{}, fmt.Errorf("kind %q: %w", kind, err)
	}
	if ev.Tags, err = decodeTags(cols[r.tags].data); err != nil {
		return evt.Delivery{}, fmt.Errorf("tags of %s: %w", ev.ID, err)
	}
	s, ok := get(r.scope)
	scopeKind, valid := scopeKind(s)
	if !ok || !valid {
		// Fail closed: a row whose read gate cannot be read is delivered to nobody.
		return evt.Delivery{}, fmt.Errorf("events row %s without a valid scope (%q)", ev.ID, s)
	}
	scope := evt.Scope{Kind: scopeKind}
	scope.P, _ = get(r.scopeP)
	scope.Channel, _ = get(r.channelID)
	return evt.Delivery{Event: &ev, Scope: scope}, nil
}

// decodeEvent reads a nostr event object; tags are never nil, so the event serialises as it was
// signed.
func decodeEvent(l *jlexer.Lexer) *nostr.Event {
	ev := &nostr.Event{}
	ev.UnmarshalEasyJSON(l)
	if ev.Tags == nil {
		ev.Tags = nostr.Tags{}
	}
	return ev
}

// decodeTags parses a stored tags array (jsonb text: an array of arrays of strings); never nil.
func decodeTags(data []byte) (nostr.Tags, error) {
	l := jlexer.Lexer{Data: data}
	tags := nostr.Tags{}
	l.Delim('[')
	for !l.IsDelim(']') && l.Ok() {
		tag := nostr.Tag{} // an empty tag stays [] when the event is serialised again (its id covers it)
		l.Delim('[')
		for !l.IsDelim(']') && l.Ok() {
			tag = append(tag, l.String())
			l.WantComma()
		}
		l.Delim(']')
		tags = append(tags, tag)
		l.WantComma()
	}
	l.Delim(']')
	l.Consumed()
	return tags, l.Error()
}

// scopeKind reads a stored or emitted read gate; anything but the four gate classes is invalid.
func scopeKind(s string) (evt.ScopeKind, bool) {
	if len(s) != 1 {
		return 0, false
	}
	switch k := evt.ScopeKind(s[0]); k {
	case evt.ScopePublic, evt.ScopeAuthor, evt.ScopeP, evt.ScopeChannel:
		return k, true
	}
	return 0, false
}
