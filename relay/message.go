package relay

import (
	"encoding/json"
	"strconv"
	"unicode/utf8"

	"github.com/mailru/easyjson/jlexer"
	"github.com/mailru/easyjson/jwriter"
	"github.com/nbd-wtf/go-nostr"
	"github.com/tidwall/gjson"
)

type verb int

const (
	verbNone verb = iota
	verbEVENT
	verbREQ
	verbCOUNT
	verbCLOSE
	verbAUTH
)

// clientMessage is one parsed client-to-relay message.
type clientMessage struct {
	verb    verb
	event   *nostr.Event   // EVENT, AUTH
	subID   string         // REQ, COUNT, CLOSE
	filters []nostr.Filter // REQ, COUNT
}

// parseError says why a message was refused and what it belonged to, so the reply can be the one
// NIP-01 asks for: OK for an EVENT whose id is known, CLOSED for a REQ/COUNT with a sub id, else NOTICE.
type parseError struct {
	msg     string
	verb    verb
	subID   string
	eventID string
}

// parseClientMessage parses strictly: exact verbs, exact arity, typed fields. go-nostr's
// ParseMessage matches verbs by substring and reports no reason, so the relay has its own parser,
// built on the same easyjson lexer and go-nostr types.
func parseClientMessage(data []byte) (*clientMessage, *parseError) {
	if !utf8.Valid(data) {
		return nil, &parseError{msg: "message is not valid UTF-8"}
	}
	if !json.Valid(data) {
		// Checked up front so that broken JSON is always a NOTICE, never half-interpreted.
		return nil, &parseError{msg: "message is not valid JSON"}
	}
	in := jlexer.Lexer{Data: data}
	in.Delim('[')
	label := in.String()
	if in.Error() != nil {
		return nil, &parseError{msg: "message must be a JSON array starting with a verb"}
	}
	in.WantComma()
	m := &clientMessage{}
	var pe *parseError
	switch label {
	case "EVENT", "AUTH":
		pe = m.parseEventArgs(&in, label, data)
	case "REQ", "COUNT", "CLOSE":
		pe = m.parseSubArgs(&in, label)
	default:
		if len(label) > 20 {
			label = label[:20]
		}
		return nil, &parseError{msg: "unknown message type " + strconv.Quote(label)}
	}
	if pe != nil {
		return nil, pe
	}
	in.Delim(']')
	in.Consumed()
	if in.Error() != nil {
		pe := &parseError{msg: "malformed " + label + " message", verb: m.verb, subID: m.subID}
		if m.event != nil {
			pe.eventID = m.event.ID
		}
		return nil, pe
	}
	return m, nil
}

// refuse is a parseError for m as far as it was read.
func (m *clientMessage) refuse(what string) *parseError {
	return &parseError{msg: what, verb: m.verb, subID: m.subID}
}

// parseEventArgs reads what follows EVENT or AUTH: exactly one event.
func (m *clientMessage) parseEventArgs(in *jlexer.Lexer, label string, data []byte) *parseError {
	m.verb = verbEVENT
	if label == "AUTH" {
		m.verb = verbAUTH
	}
	if in.IsDelim(']') {
		return m.refuse(label + " needs an event")
	}
	ev, err := decodeEvent(in)
	if err != "" {
		return &parseError{msg: err, verb: m.verb, eventID: eventIDOf(data)}
	}
	in.WantComma()
	if !in.IsDelim(']') {
		return &parseError{msg: label + " takes exactly one event", verb: m.verb, eventID: ev.ID}
	}
	m.event = ev
	return nil
}

// parseSubArgs reads what follows REQ, COUNT or CLOSE: a subscription id, then (REQ, COUNT) one
// filter or more.
func (m *clientMessage) parseSubArgs(in *jlexer.Lexer, label string) *parseError {
	m.verb = map[string]verb{"REQ": verbREQ, "COUNT": verbCOUNT, "CLOSE": verbCLOSE}[label]
	m.subID = in.String()
	if in.Error() != nil {
		return m.refuse(label + " needs a subscription id string")
	}
	// NIP-01 counts the id in characters, not bytes.
	if m.subID == "" || utf8.RuneCountInString(m.subID) > maxSubIDLength {
		pe := &parseError{msg: "subscription id must be 1-" + strconv.Itoa(maxSubIDLength) + " characters", verb: m.verb}
		// The CLOSED names the id as sent: cut short, it could name another, live subscription.
		// An id too long to echo gets a NOTICE instead.
		if len(m.subID) <= maxEchoedSubIDBytes {
			pe.subID = m.subID
		}
		return pe
	}
	in.WantComma()
	if m.verb == verbCLOSE {
		return nil
	}
	for !in.IsDelim(']') {
		var f nostr.Filter
		if !in.IsDelim('{') {
			return m.refuse("filters must be JSON objects")
		}
		f.UnmarshalEasyJSON(in)
		if in.Error() != nil {
			return m.refuse("malformed filter")
		}
		m.filters = append(m.filters, f)
		in.WantComma()
	}
	if len(m.filters) == 0 {
		return m.refuse(label + " needs at least one filter")
	}
	return nil
}

// eventIDOf digs a well-formed id out of a malformed EVENT so it still gets its OK.
func eventIDOf(data []byte) string {
	id := gjson.GetBytes(data, "1.id")
	if id.Type == gjson.String && isHex(id.Str, 64) {
		return id.Str
	}
	return ""
}

const (
	fID = 1 << iota
	fPubkey
	fCreatedAt
	fKind
	fTags
	fContent
	fSig
	fAll = fID | fPubkey | fCreatedAt | fKind | fTags | fContent | fSig
)

// decodeEvent reads one event object strictly: every NIP-01 field present exactly once with its
// JSON type, tags an array of arrays of strings. Unknown fields are skipped (they are not part of
// the id and are not stored). Returns a reason on failure.
func decodeEvent(in *jlexer.Lexer) (*nostr.Event, string) {
	ev := &nostr.Event{}
	seen := 0
	if !in.IsDelim('{') {
		return nil, "event must be a JSON object"
	}
	in.Delim('{')
	for !in.IsDelim('}') {
		key := in.UnsafeFieldName(false)
		in.WantColon()
		if in.Error() != nil {
			return nil, "malformed event"
		}
		bit := 0
		switch key {
		case "id":
			bit = fID
			ev.ID = in.String()
		case "pubkey":
			bit = fPubkey
			ev.PubKey = in.String()
		case "created_at":
			bit = fCreatedAt
			ev.CreatedAt = nostr.Timestamp(in.Int64())
		case "kind":
			bit = fKind
			ev.Kind = in.Int()
		case "content":
			bit = fContent
			ev.Content = in.String()
		case "sig":
			bit = fSig
			ev.Sig = in.String()
		case "tags":
			bit = fTags
			ev.Tags = decodeTags(in)
		default:
			in.SkipRecursive()
		}
		if in.Error() != nil {
			if key == "tags" {
				return nil, "tags must be an array of arrays of strings"
			}
			return nil, "malformed event field " + strconv.Quote(truncate(key, 20))
		}
		if bit != 0 {
			if seen&bit != 0 {
				return nil, "duplicate event field " + strconv.Quote(key)
			}
			seen |= bit
		}
		in.WantComma()
	}
	in.Delim('}')
	if in.Error() != nil {
		return nil, "malformed event"
	}
	if seen != fAll {
		return nil, "event is missing a field (id, pubkey, created_at, kind, tags, content and sig are required)"
	}
	return ev, ""
}

func decodeTags(in *jlexer.Lexer) nostr.Tags {
	tags := nostr.Tags{}
	in.Delim('[')
	for !in.IsDelim(']') {
		in.Delim('[')
		tag := nostr.Tag{}
		for !in.IsDelim(']') {
			tag = append(tag, in.String())
			in.WantComma()
		}
		in.Delim(']')
		tags = append(tags, tag)
		in.WantComma()
		if in.Error() != nil {
			return nil
		}
	}
	in.Delim(']')
	return tags
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	// Do not cut a UTF-8 sequence in half.
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// ---- relay-to-client messages ----

func newWriter() *jwriter.Writer { return &jwriter.Writer{NoEscapeHTML: true} }

// marshalArray builds ["VERB","s1","s2",...] with JSON-escaped strings.
func marshalArray(verb string, parts ...string) []byte {
	w := newWriter()
	w.RawByte('[')
	w.String(verb)
	for _, p := range parts {
		w.RawByte(',')
		w.String(p)
	}
	w.RawByte(']')
	b, _ := w.BuildBytes()
	return b
}

func marshalOK(id string, ok bool, msg string) []byte {
	w := newWriter()
	w.RawString(`["OK",`)
	w.String(id)
	w.RawByte(',')
	w.Bool(ok)
	w.RawByte(',')
	w.String(msg)
	w.RawByte(']')
	b, _ := w.BuildBytes()
	return b
}

func marshalCount(subID string, n int64) []byte {
	w := newWriter()
	w.RawString(`["COUNT",`)
	w.String(subID)
	w.RawString(`,{"count":`)
	w.Int64(n)
	w.RawString(`}]`)
	b, _ := w.BuildBytes()
	return b
}

// eventPrefix is `["EVENT","<sub id>",`, built once per subscription.
func eventPrefix(subID string) []byte {
	w := newWriter()
	w.RawString(`["EVENT",`)
	w.String(subID)
	w.RawByte(',')
	b, _ := w.BuildBytes()
	return b
}

// eventMessage joins a subscription's prefix with an event's JSON.
func eventMessage(prefix, eventJSON []byte) []byte {
	b := make([]byte, 0, len(prefix)+len(eventJSON)+1)
	b = append(b, prefix...)
	b = append(b, eventJSON...)
	return append(b, ']')
}

// writeEventHead writes `{"id":…,"pubkey":…,"created_at":…,"kind":…` — the part of an event's
// JSON that live events and stored rows share.
func writeEventHead(w *jwriter.Writer, ev *nostr.Event) {
	w.RawString(`{"id":`)
	w.String(ev.ID)
	w.RawString(`,"pubkey":`)
	w.String(ev.PubKey)
	w.RawString(`,"created_at":`)
	w.Int64(int64(ev.CreatedAt))
	w.RawString(`,"kind":`)
	w.Int(ev.Kind)
}

// eventJSON is the canonical JSON of an event (only NIP-01 fields).
func eventJSON(ev *nostr.Event) []byte {
	w := newWriter()
	writeEventHead(w, ev)
	w.RawString(`,"tags":[`)
	for i, t := range ev.Tags {
		if i > 0 {
			w.RawByte(',')
		}
		w.RawByte('[')
		for j, v := range t {
			if j > 0 {
				w.RawByte(',')
			}
			w.String(v)
		}
		w.RawByte(']')
	}
	w.RawString(`],"content":`)
	return finishEvent(w, ev)
}

// finishEvent writes the content, the signature and the closing brace after the tags, which live
// events and stored rows write each their own way, and returns the bytes.
func finishEvent(w *jwriter.Writer, ev *nostr.Event) []byte {
	w.String(ev.Content)
	w.RawString(`,"sig":`)
	w.String(ev.Sig)
	w.RawByte('}')
	b, _ := w.BuildBytes()
	return b
}
