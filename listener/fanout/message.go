package fanout

import (
	"fmt"

	"github.com/mailru/easyjson/jlexer"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// message is the payload of a 'buzz' logical message (see the emitting SQL):
//
//	{"t":"eph","ev":{...},"scope":"*","scope_p":null,"channel_id":null}
//	{"t":"due","ev":{...the 30300 event...},"stamp":123,"scope":"a"}
//	{"t":"dues","scope":"a","items":[{"ev":{...},"stamp":123}, ...]}   (one per confirmed batch)
//	{"t":"members","channels":["<uuid>", ...]} or {"t":"members","all":true}   (member rows edited)
type message struct {
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

// contents is what one 'buzz' logical message hands over: ephemeral events, due signals, or a
// change of member rows.
type contents struct {
	events  []evt.Delivery
	dues    []evt.Due
	members *evt.MembersChange
}

// decodeMessage turns a 'buzz' logical message into what it hands over. ok is false for message
// types this version does not know (a newer process may emit more): they are skipped, not fatal.
// Due signals are author-only (docs/protocol.md) whatever scope the emitter wrote: the sink
// gates them so.
func decodeMessage(content []byte) (c contents, ok bool, err error) {
	var m message
	if err := m.decode(content); err != nil {
		return c, false, fmt.Errorf("buzz message: %w", err)
	}
	switch m.T {
	case "eph", "due":
		if m.Ev == nil {
			return c, false, fmt.Errorf("buzz message %q without ev", m.T)
		}
		if m.T == "due" {
			c.dues = []evt.Due{{Event: m.Ev, Stamp: m.Stamp}}
			return c, true, nil
		}
		scope, err := m.scope()
		if err != nil {
			return c, false, err
		}
		c.events = []evt.Delivery{{Event: m.Ev, Scope: scope}}
		return c, true, nil
	case "members":
		if len(m.Channels) == 0 && !m.All {
			return c, false, fmt.Errorf("buzz message \"members\" names no channel")
		}
		c.members = &evt.MembersChange{Channels: m.Channels, All: m.All}
		return c, true, nil
	case "dues":
		c.dues = make([]evt.Due, 0, len(m.Items))
		for i, it := range m.Items {
			if it.Ev == nil {
				return contents{}, false, fmt.Errorf("buzz message \"dues\": item %d without ev", i)
			}
			c.dues = append(c.dues, evt.Due{Event: it.Ev, Stamp: it.Stamp})
		}
		return c, true, nil
	}
	return c, false, nil
}

// scope is the read gate an "eph" message names.
func (m *message) scope() (evt.Scope, error) {
	kind, valid := scopeKind(m.Scope)
	if !valid {
		return evt.Scope{}, fmt.Errorf("buzz message %q without a valid scope (%q)", m.T, m.Scope)
	}
	scope := evt.Scope{Kind: kind}
	if m.ScopeP != nil {
		scope.P = *m.ScopeP
	}
	if m.ChannelID != nil {
		scope.Channel = *m.ChannelID
	}
	return scope, nil
}

// decode parses the payload in one pass. encoding/json would validate the whole payload and then
// hand the event to its easyjson decoder, which parses it again; every process decodes every
// message, so this is on the fan-out hot path.
func (m *message) decode(data []byte) error {
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
