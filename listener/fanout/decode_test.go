package fanout

import (
	"encoding/binary"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// The one-pass decoders must agree with encoding/json on what SQL emits, and refuse what is not
// JSON of that shape instead of delivering half an event.
func TestDecodeMessage(t *testing.T) {
	sk := nostr.GeneratePrivateKey()
	ev := nostr.Event{Kind: 30300, CreatedAt: 1700000000, Content: "x\"y\\u00e9",
		Tags: nostr.Tags{{"d", "a"}, {}, {"not_before", "1700000001", ""}}}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(ev)
	payload := `{"t":"due","ev":` + string(raw) + `,"stamp":42,"scope":"a","extra":{"x":[1,2]}}`
	c, ok, err := decodeMessage([]byte(payload))
	if err != nil || !ok || len(c.dues) != 1 || len(c.events) != 0 || c.members != nil {
		t.Fatalf("due message: %+v, ok=%v err=%v", c, ok, err)
	}
	// A due signal carries no scope: it is author-only (the sink gates it so), whatever the
	// emitter wrote.
	d := c.dues[0]
	if d.Stamp != 42 {
		t.Fatalf("due signal %+v", d)
	}
	if !d.Event.CheckID() {
		t.Fatalf("decoded event no longer matches its id: %s", d.Event)
	}
	if ok, _ := d.Event.CheckSignature(); !ok {
		t.Fatal("decoded event fails its signature")
	}

	eph := `{"t":"eph","ev":` + string(raw) + `,"scope":"p","scope_p":"abc","channel_id":null}`
	c, ok, err = decodeMessage([]byte(eph))
	if err != nil || !ok || len(c.events) != 1 || len(c.dues) != 0 || c.events[0].Scope.Kind != evt.ScopeKind('p') || c.events[0].Scope.P != "abc" || c.events[0].Scope.Channel != "" {
		t.Fatalf("eph message: %+v ok=%v err=%v", c, ok, err)
	}

	// A batch: every item is an author-only due signal with its own stamp, whatever scope the
	// emitter wrote.
	dues := `{"t":"dues","scope":"*","items":[{"ev":` + string(raw) + `,"stamp":7},{"stamp":8,"ev":` + string(raw) + `}]}`
	c, ok, err = decodeMessage([]byte(dues))
	if err != nil || !ok || len(c.dues) != 2 || len(c.events) != 0 {
		t.Fatalf("dues message: %+v, ok=%v err=%v", c, ok, err)
	}
	for i, want := range []int64{7, 8} {
		if d := c.dues[i]; d.Stamp != want || d.Event.ID != ev.ID || !d.Event.CheckID() {
			t.Fatalf("dues item %d: %+v", i, d)
		}
	}
	if c, ok, err := decodeMessage([]byte(`{"t":"dues","scope":"a","items":[]}`)); err != nil || !ok || len(c.dues) != 0 {
		t.Fatalf("empty dues: %d, ok=%v err=%v", len(c.dues), ok, err)
	}

	// An ephemeral event whose read gate cannot be read goes to nobody (fail closed), never to all.
	for _, scope := range []string{``, `,"scope":null`, `,"scope":""`, `,"scope":"x"`, `,"scope":"**"`} {
		msg := `{"t":"eph","ev":` + string(raw) + scope + `}`
		if c, ok, err := decodeMessage([]byte(msg)); err == nil || ok || len(c.events) != 0 {
			t.Errorf("eph with scope %q: %d deliveries, ok=%v err=%v; want an error", scope, len(c.events), ok, err)
		}
	}

	if _, ok, err := decodeMessage([]byte(`{"t":"future","ev":` + string(raw) + `}`)); err != nil || ok {
		t.Fatalf("unknown type: ok=%v err=%v, want skipped without error", ok, err)
	}
	for _, bad := range []string{``, `{`, `{"t":"due"}`, `{"t":"due","ev":` + string(raw), `[1]`, `{"t":"due","ev":{}} x`,
		`{"t":"dues","items":[{"stamp":1}]}`, `{"t":"dues","items":[{"ev":` + string(raw) + `,"stamp":1}`, `{"t":"dues","items":{}}`} {
		if _, ok, err := decodeMessage([]byte(bad)); err == nil || ok {
			t.Errorf("%q: ok=%v err=%v, want an error", bad, ok, err)
		}
	}
}

func TestDecodeTags(t *testing.T) {
	for _, in := range []string{`[]`, `[[]]`, `[["e","x"],["p","y","wss://r",""]]`, `[["a\"b\\u0000c"]]`} {
		got, err := decodeTags([]byte(in))
		if err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		var want nostr.Tags
		_ = json.Unmarshal([]byte(in), &want)
		a, _ := json.Marshal(got)
		b, _ := json.Marshal(want)
		if string(a) != string(b) {
			t.Errorf("%s: decoded %s, encoding/json %s", in, a, b)
		}
	}
	for _, bad := range []string{``, `[`, `[[1]]`, `{}`, `[["a"]] x`} {
		if _, err := decodeTags([]byte(bad)); err == nil {
			t.Errorf("%q decoded without error", bad)
		}
	}
}

// A stored row without a valid scope column is skipped, not delivered as public.
func TestDecodeRowFailsClosedOnScope(t *testing.T) {
	cols := []string{"id", "pubkey", "created_at", "kind", "tags", "content", "sig", "scope", "scope_p", "channel_id"}
	rel := &pglogrepl.RelationMessage{Namespace: "buzz", RelationName: "events"}
	for _, c := range cols {
		rel.Columns = append(rel.Columns, &pglogrepl.RelationMessageColumn{Name: c})
	}
	r := newRelation(rel)
	row := func(scope *string) []column {
		vals := []string{strings.Repeat("a", 64), strings.Repeat("b", 64), "1700000000", "1", "[]", "hi", strings.Repeat("c", 128)}
		var cols []column
		for _, v := range vals {
			cols = append(cols, column{data: []byte(v)})
		}
		if scope == nil {
			cols = append(cols, column{null: true})
		} else {
			cols = append(cols, column{data: []byte(*scope)})
		}
		return append(cols, column{null: true}, column{null: true})
	}
	str := func(s string) *string { return &s }
	if d, err := decodeRow(r, row(str("*"))); err != nil || d.Scope.Kind != evt.ScopePublic {
		t.Fatalf("public row: %+v %v", d, err)
	}
	for _, bad := range []*string{nil, str(""), str("x"), str("ab")} {
		if d, err := decodeRow(r, row(bad)); err == nil {
			t.Errorf("scope %v decoded as %+v, want an error", bad, d.Scope)
		}
	}
}

// A member edit (sql/0005_fanout) decodes to a member change without an event; one naming nothing
// is refused rather than read as "forget nothing".
func TestDecodeMembersMessage(t *testing.T) {
	c, ok, err := decodeMessage([]byte(`{"t":"members","channels":["5f0c0c9e-7d4e-4b8e-9d3c-0e6a4f1b2c3d","6a1d1daf-8e5f-4c9f-8e4d-1f7b502c3d4e"]}`))
	if err != nil || !ok || c.members == nil || len(c.events) != 0 || len(c.dues) != 0 {
		t.Fatalf("members message: %+v ok=%v err=%v", c, ok, err)
	}
	if got := c.members.Channels; len(got) != 2 || got[1] != "6a1d1daf-8e5f-4c9f-8e4d-1f7b502c3d4e" || c.members.All {
		t.Fatalf("channels %v all %v", got, c.members.All)
	}
	c, ok, err = decodeMessage([]byte(`{"t":"members","all":true}`))
	if err != nil || !ok || c.members == nil || !c.members.All {
		t.Fatalf("truncate message: %+v ok=%v err=%v", c, ok, err)
	}
	if _, ok, err := decodeMessage([]byte(`{"t":"members","channels":[]}`)); err == nil || ok {
		t.Fatalf("a members message naming nothing: ok=%v err=%v, want an error", ok, err)
	}
}

// insertMessage is a pgoutput Insert message: relation OID, then a new tuple of vals, where nil is
// NULL and "\x00u" an unchanged TOAST value.
func insertMessage(relID uint32, vals []*string) []byte {
	m := []byte{'I'}
	m = binary.BigEndian.AppendUint32(m, relID)
	m = append(m, 'N')
	m = binary.BigEndian.AppendUint16(m, uint16(len(vals)))
	for _, v := range vals {
		switch {
		case v == nil:
			m = append(m, 'n')
		case *v == "\x00u":
			m = append(m, 'u')
		default:
			m = append(m, 't')
			m = binary.BigEndian.AppendUint32(m, uint32(len(*v)))
			m = append(m, *v...)
		}
	}
	return m
}

// parseInsert reads what pglogrepl.Parse reads, without copying; a message cut anywhere is an
// error, never a panic or a value read past its end.
func TestParseInsertAgreesWithPglogrepl(t *testing.T) {
	str := func(s string) *string { return &s }
	msg := insertMessage(16384, []*string{str("abc"), nil, str(""), str("\x00u"), str(strings.Repeat("x", 300))})
	want, err := pglogrepl.Parse(msg)
	if err != nil {
		t.Fatal(err)
	}
	ins := want.(*pglogrepl.InsertMessage)
	relID, cols, err := parseInsert(msg, nil)
	if err != nil || relID != ins.RelationID || len(cols) != len(ins.Tuple.Columns) {
		t.Fatalf("parseInsert: rel %d, %d columns, %v; pglogrepl: rel %d, %d columns", relID, len(cols), err,
			ins.RelationID, len(ins.Tuple.Columns))
	}
	for i, c := range ins.Tuple.Columns {
		if isText := c.DataType == pglogrepl.TupleDataTypeText; cols[i].null == isText || string(cols[i].data) != string(c.Data) {
			t.Errorf("column %d: %+v, pglogrepl %q %q", i, cols[i], c.DataType, c.Data)
		}
	}
	for cut := range len(msg) {
		if _, _, err := parseInsert(msg[:cut], cols); err == nil {
			t.Errorf("message cut at %d of %d parsed", cut, len(msg))
		}
	}
}
