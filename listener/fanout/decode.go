package fanout

import (
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

// relation remembers where each column of a replicated table sits in its tuples. pgoutput sends a
// Relation message before the first change of a table in every session (and again after DDL), so
// the map is per session and keyed by relation OID.
type relation struct {
	schema, table string
	col           map[string]int
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{schema: m.Namespace, table: m.RelationName, col: make(map[string]int, len(m.Columns))}
	for i, c := range m.Columns {
		r.col[c.Name] = i
	}
	return r
}

// decodeRow turns a buzz.events INSERT tuple (pgoutput text format) into a delivery.
func decodeRow(r *relation, t *pglogrepl.TupleData) (evt.Delivery, error) {
	get := func(name string) (string, bool) {
		i, ok := r.col[name]
		if !ok || i >= len(t.Columns) {
			return "", false
		}
		c := t.Columns[i]
		if c.DataType != pglogrepl.TupleDataTypeText {
			return "", false // NULL (or unchanged TOAST, which an INSERT never carries)
		}
		return string(c.Data), true
	}
	need := func(name string) (string, error) {
		v, ok := get(name)
		if !ok {
			return "", fmt.Errorf("buzz.events row without %s", name)
		}
		return v, nil
	}
	var ev nostr.Event
	var err error
	if ev.ID, err = need("id"); err != nil {
		return evt.Delivery{}, err
	}
	if ev.PubKey, err = need("pubkey"); err != nil {
		return evt.Delivery{}, err
	}
	if ev.Sig, err = need("sig"); err != nil {
		return evt.Delivery{}, err
	}
	if ev.Content, err = need("content"); err != nil {
		return evt.Delivery{}, err
	}
	s, err := need("created_at")
	if err != nil {
		return evt.Delivery{}, err
	}
	ca, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return evt.Delivery{}, fmt.Errorf("created_at %q: %w", s, err)
	}
	ev.CreatedAt = nostr.Timestamp(ca)
	if s, err = need("kind"); err != nil {
		return evt.Delivery{}, err
	}
	if ev.Kind, err = strconv.Atoi(s); err != nil {
		return evt.Delivery{}, fmt.Errorf("kind %q: %w", s, err)
	}
	if s, err = need("tags"); err != nil {
		return evt.Delivery{}, err
	}
	if ev.Tags, err = decodeTags([]byte(s)); err != nil {
		return evt.Delivery{}, fmt.Errorf("tags of %s: %w", ev.ID, err)
	}
	s, ok := get("scope")
	kind, valid := scopeKind(s)
	if !ok || !valid {
		// Fail closed: a row whose read gate cannot be read is delivered to nobody.
		return evt.Delivery{}, fmt.Errorf("events row %s without a valid scope (%q)", ev.ID, s)
	}
	scope := evt.Scope{Kind: kind}
	scope.P, _ = get("scope_p")
	scope.Channel, _ = get("channel_id")
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
