package listener

import (
	"encoding/json"
	"fmt"
	"strconv"

	"github.com/jackc/pglogrepl"
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
	if err := json.Unmarshal([]byte(s), &ev.Tags); err != nil {
		return evt.Delivery{}, fmt.Errorf("tags of %s: %w", ev.ID, err)
	}
	if ev.Tags == nil {
		ev.Tags = nostr.Tags{}
	}
	scope := evt.Scope{Kind: evt.ScopePublic}
	if s, ok := get("scope"); ok && len(s) == 1 {
		scope.Kind = evt.ScopeKind(s[0])
	}
	scope.P, _ = get("scope_p")
	scope.Channel, _ = get("channel_id")
	return evt.Delivery{Event: &ev, Scope: scope}, nil
}

// fanMessage is the payload of a 'buzz' logical message (see the emitting SQL):
//
//	{"t":"eph","ev":{...},"scope":"*","scope_p":null,"channel_id":null}
//	{"t":"due","ev":{...the 30300 event...},"stamp":123,"scope":"a"}
type fanMessage struct {
	T         string       `json:"t"`
	Ev        *nostr.Event `json:"ev"`
	Scope     string       `json:"scope"`
	ScopeP    *string      `json:"scope_p"`
	ChannelID *string      `json:"channel_id"`
	Stamp     int64        `json:"stamp"`
}

// fanDecodeMessage turns a 'buzz' logical message into a Delivery. ok is false for message types
// this version does not know (a newer process may emit more): they are skipped, not fatal.
func fanDecodeMessage(content []byte) (d evt.Delivery, ok bool, err error) {
	var m fanMessage
	if err := json.Unmarshal(content, &m); err != nil {
		return d, false, fmt.Errorf("buzz message: %w", err)
	}
	if m.Ev == nil {
		return d, false, fmt.Errorf("buzz message %q without ev", m.T)
	}
	if m.Ev.Tags == nil {
		m.Ev.Tags = nostr.Tags{}
	}
	scope := evt.Scope{Kind: evt.ScopePublic}
	if len(m.Scope) == 1 {
		scope.Kind = evt.ScopeKind(m.Scope[0])
	}
	if m.ScopeP != nil {
		scope.P = *m.ScopeP
	}
	if m.ChannelID != nil {
		scope.Channel = *m.ChannelID
	}
	switch m.T {
	case "eph":
		return evt.Delivery{Event: m.Ev, Scope: scope}, true, nil
	case "due":
		if len(m.Scope) != 1 {
			scope.Kind = evt.ScopeAuthor // reminders are author-only whatever the emitter forgot
		}
		return evt.Delivery{Event: m.Ev, Scope: scope, Due: true, Stamp: m.Stamp}, true, nil
	}
	return d, false, nil
}

// fanDedupeKey identifies one delivery: the event id, plus the stamp for a due signal (a reminder
// version re-claimed after a lease is a new signal with the same id).
func fanDedupeKey(d evt.Delivery) string {
	if d.Due {
		return d.Event.ID + "/" + strconv.FormatInt(d.Stamp, 10)
	}
	return d.Event.ID
}
