package listener

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
type pgRelation struct {
	schema, table string
	col           map[string]int
}

func newPgRelation(m *pglogrepl.RelationMessage) *pgRelation {
	r := &pgRelation{schema: m.Namespace, table: m.RelationName, col: make(map[string]int, len(m.Columns))}
	for i, c := range m.Columns {
		r.col[c.Name] = i
	}
	return r
}

// fanDecodeRow turns a buzz.events INSERT tuple (pgoutput text format) into a Delivery.
func fanDecodeRow(r *pgRelation, t *pglogrepl.TupleData) (evt.Delivery, error) {
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

// fanMessage is the payload of a 'buzz' logical message (see the emitting SQL):
//
//	{"t":"eph","ev":{...},"scope":"*","scope_p":null,"channel_id":null}
//	{"t":"due","ev":{...the 30300 event...},"stamp":123,"scope":"a"}
//	{"t":"dues","scope":"a","items":[{"ev":{...},"stamp":123}, ...]}   (one per confirmed batch)
//	{"t":"members","channels":["<uuid>", ...]} or {"t":"members","all":true}   (member rows edited)
type fanMessage struct {
	T         string
	Ev        *nostr.Event
	Scope     string
	ScopeP    *string
	ChannelID *string
	Stamp     int64
	Items     []dueItem
	Channels  []string
	All       bool
}

type dueItem struct {
	Ev    *nostr.Event
	Stamp int64
}

// fanDecodeMessage turns a 'buzz' logical message into its deliveries. ok is false for message
// types this version does not know (a newer process may emit more): they are skipped, not fatal.
func fanDecodeMessage(content []byte) (ds []evt.Delivery, ok bool, err error) {
	var m fanMessage
	if err := m.decode(content); err != nil {
		return nil, false, fmt.Errorf("buzz message: %w", err)
	}
	// Due signals are author-only (PROTOCOL.md) whatever scope the emitter wrote.
	author := evt.Scope{Kind: evt.ScopeAuthor}
	switch m.T {
	case "eph", "due":
		if m.Ev == nil {
			return nil, false, fmt.Errorf("buzz message %q without ev", m.T)
		}
		if m.T == "due" {
			return []evt.Delivery{{Event: m.Ev, Scope: author, Due: true, Stamp: m.Stamp}}, true, nil
		}
		kind, valid := scopeKind(m.Scope)
		if !valid {
			return nil, false, fmt.Errorf("buzz message %q without a valid scope (%q)", m.T, m.Scope)
		}
		scope := evt.Scope{Kind: kind}
		if m.ScopeP != nil {
			scope.P = *m.ScopeP
		}
		if m.ChannelID != nil {
			scope.Channel = *m.ChannelID
		}
		return []evt.Delivery{{Event: m.Ev, Scope: scope}}, true, nil
	case "members":
		if len(m.Channels) == 0 && !m.All {
			return nil, false, fmt.Errorf("buzz message \"members\" names no channel")
		}
		return []evt.Delivery{{Members: &evt.MembersChange{Channels: m.Channels, All: m.All}}}, true, nil
	case "dues":
		ds = make([]evt.Delivery, 0, len(m.Items))
		for i, it := range m.Items {
			if it.Ev == nil {
				return nil, false, fmt.Errorf("buzz message \"dues\": item %d without ev", i)
			}
			ds = append(ds, evt.Delivery{Event: it.Ev, Scope: author, Due: true, Stamp: it.Stamp})
		}
		return ds, true, nil
	}
	return nil, false, nil
}

// decode parses the payload in one pass. encoding/json would validate the whole payload and then
// hand the event to its easyjson decoder, which parses it again; every process decodes every
// message, so this is on the fan-out hot path.
func (m *fanMessage) decode(data []byte) error {
	l := jlexer.Lexer{Data: data}
	l.Delim('{')
	for !l.IsDelim('}') && l.Ok() {
		key := l.UnsafeFieldName(false)
		l.WantColon()
		if l.IsNull() {
			l.Skip()
			l.WantComma()
			continue
		}
		switch key {
		case "t":
			m.T = l.String()
		case "ev":
			m.Ev = decodeEvent(&l)
		case "scope":
			m.Scope = l.String()
		case "scope_p":
			v := l.String()
			m.ScopeP = &v
		case "channel_id":
			v := l.String()
			m.ChannelID = &v
		case "stamp":
			m.Stamp = l.Int64()
		case "items":
			l.Delim('[')
			for !l.IsDelim(']') && l.Ok() {
				m.Items = append(m.Items, decodeDueItem(&l))
				l.WantComma()
			}
			l.Delim(']')
		case "channels":
			l.Delim('[')
			for !l.IsDelim(']') && l.Ok() {
				m.Channels = append(m.Channels, l.String())
				l.WantComma()
			}
			l.Delim(']')
		case "all":
			m.All = l.Bool()
		default:
			l.SkipRecursive()
		}
		l.WantComma()
	}
	l.Delim('}')
	l.Consumed()
	return l.Error()
}

func decodeDueItem(l *jlexer.Lexer) (it dueItem) {
	l.Delim('{')
	for !l.IsDelim('}') && l.Ok() {
		key := l.UnsafeFieldName(false)
		l.WantColon()
		switch {
		case l.IsNull():
			l.Skip()
		case key == "ev":
			it.Ev = decodeEvent(l)
		case key == "stamp":
			it.Stamp = l.Int64()
		default:
			l.SkipRecursive()
		}
		l.WantComma()
	}
	l.Delim('}')
	return it
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

// fanDedupeKey identifies one delivery: the event id, plus the stamp for a due signal (a reminder
// version re-claimed after a lease is a new signal with the same id).
func fanDedupeKey(d evt.Delivery) string {
	if d.Due {
		return d.Event.ID + "/" + strconv.FormatInt(d.Stamp, 10)
	}
	return d.Event.ID
}
