package listener

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
)

// The one-pass decoders must agree with encoding/json on what SQL emits, and refuse what is not
// JSON of that shape instead of delivering half an event.
func TestFanDecodeMessage(t *testing.T) {
	sk := nostr.GeneratePrivateKey()
	ev := nostr.Event{Kind: 30300, CreatedAt: 1700000000, Content: "x\"y\\u00e9",
		Tags: nostr.Tags{{"d", "a"}, {}, {"not_before", "1700000001", ""}}}
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(ev)
	payload := `{"t":"due","ev":` + string(raw) + `,"stamp":42,"scope":"a","extra":{"x":[1,2]}}`
	ds, ok, err := fanDecodeMessage([]byte(payload))
	if err != nil || !ok || len(ds) != 1 {
		t.Fatalf("due message: %d deliveries, ok=%v err=%v", len(ds), ok, err)
	}
	d := ds[0]
	if !d.Due || d.Stamp != 42 || d.Scope.Kind != evt.ScopeAuthor {
		t.Fatalf("due delivery %+v", d)
	}
	if !d.Event.CheckID() {
		t.Fatalf("decoded event no longer matches its id: %s", d.Event)
	}
	if ok, _ := d.Event.CheckSignature(); !ok {
		t.Fatal("decoded event fails its signature")
	}

	eph := `{"t":"eph","ev":` + string(raw) + `,"scope":"p","scope_p":"abc","channel_id":null}`
	ds, ok, err = fanDecodeMessage([]byte(eph))
	if err != nil || !ok || len(ds) != 1 || ds[0].Due || ds[0].Scope.Kind != evt.ScopeKind('p') || ds[0].Scope.P != "abc" || ds[0].Scope.Channel != "" {
		t.Fatalf("eph message: %+v ok=%v err=%v", ds, ok, err)
	}

	// A batch: every item is an author-only due signal with its own stamp, whatever scope the
	// emitter wrote.
	dues := `{"t":"dues","scope":"*","items":[{"ev":` + string(raw) + `,"stamp":7},{"stamp":8,"ev":` + string(raw) + `}]}`
	ds, ok, err = fanDecodeMessage([]byte(dues))
	if err != nil || !ok || len(ds) != 2 {
		t.Fatalf("dues message: %d deliveries, ok=%v err=%v", len(ds), ok, err)
	}
	for i, want := range []int64{7, 8} {
		if d := ds[i]; !d.Due || d.Stamp != want || d.Scope.Kind != evt.ScopeAuthor || d.Event.ID != ev.ID || !d.Event.CheckID() {
			t.Fatalf("dues item %d: %+v", i, d)
		}
	}
	if ds, ok, err := fanDecodeMessage([]byte(`{"t":"dues","scope":"a","items":[]}`)); err != nil || !ok || len(ds) != 0 {
		t.Fatalf("empty dues: %d, ok=%v err=%v", len(ds), ok, err)
	}

	// An ephemeral event whose read gate cannot be read goes to nobody (fail closed), never to all.
	for _, scope := range []string{``, `,"scope":null`, `,"scope":""`, `,"scope":"x"`, `,"scope":"**"`} {
		msg := `{"t":"eph","ev":` + string(raw) + scope + `}`
		if ds, ok, err := fanDecodeMessage([]byte(msg)); err == nil || ok || len(ds) != 0 {
			t.Errorf("eph with scope %q: %d deliveries, ok=%v err=%v; want an error", scope, len(ds), ok, err)
		}
	}

	if _, ok, err := fanDecodeMessage([]byte(`{"t":"future","ev":` + string(raw) + `}`)); err != nil || ok {
		t.Fatalf("unknown type: ok=%v err=%v, want skipped without error", ok, err)
	}
	for _, bad := range []string{``, `{`, `{"t":"due"}`, `{"t":"due","ev":` + string(raw), `[1]`, `{"t":"due","ev":{}} x`,
		`{"t":"dues","items":[{"stamp":1}]}`, `{"t":"dues","items":[{"ev":` + string(raw) + `,"stamp":1}`, `{"t":"dues","items":{}}`} {
		if _, ok, err := fanDecodeMessage([]byte(bad)); err == nil || ok {
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
func TestFanDecodeRowFailsClosedOnScope(t *testing.T) {
	cols := []string{"id", "pubkey", "created_at", "kind", "tags", "content", "sig", "scope", "scope_p", "channel_id"}
	rel := &pglogrepl.RelationMessage{Namespace: "buzz", RelationName: "events"}
	for _, c := range cols {
		rel.Columns = append(rel.Columns, &pglogrepl.RelationMessageColumn{Name: c})
	}
	r := newPgRelation(rel)
	row := func(scope *string) *pglogrepl.TupleData {
		vals := []string{strings.Repeat("a", 64), strings.Repeat("b", 64), "1700000000", "1", "[]", "hi", strings.Repeat("c", 128)}
		td := &pglogrepl.TupleData{}
		for _, v := range vals {
			td.Columns = append(td.Columns, &pglogrepl.TupleDataColumn{DataType: 't', Data: []byte(v)})
		}
		if scope == nil {
			td.Columns = append(td.Columns, &pglogrepl.TupleDataColumn{DataType: 'n'})
		} else {
			td.Columns = append(td.Columns, &pglogrepl.TupleDataColumn{DataType: 't', Data: []byte(*scope)})
		}
		td.Columns = append(td.Columns, &pglogrepl.TupleDataColumn{DataType: 'n'}, &pglogrepl.TupleDataColumn{DataType: 'n'})
		return td
	}
	str := func(s string) *string { return &s }
	if d, err := fanDecodeRow(r, row(str("*"))); err != nil || d.Scope.Kind != evt.ScopePublic {
		t.Fatalf("public row: %+v %v", d, err)
	}
	for _, bad := range []*string{nil, str(""), str("x"), str("ab")} {
		if d, err := fanDecodeRow(r, row(bad)); err == nil {
			t.Errorf("scope %v decoded as %+v, want an error", bad, d.Scope)
		}
	}
}

// A member edit (sql/0014) decodes to a Members delivery without an event; one naming nothing
// is refused rather than read as "forget nothing".
func TestFanDecodeMembersMessage(t *testing.T) {
	ds, ok, err := fanDecodeMessage([]byte(`{"t":"members","channels":["5f0c0c9e-7d4e-4b8e-9d3c-0e6a4f1b2c3d","6a1d1daf-8e5f-4c9f-8e4d-1f7b502c3d4e"]}`))
	if err != nil || !ok || len(ds) != 1 || ds[0].Members == nil || ds[0].Event != nil {
		t.Fatalf("members message: %+v ok=%v err=%v", ds, ok, err)
	}
	if got := ds[0].Members.Channels; len(got) != 2 || got[1] != "6a1d1daf-8e5f-4c9f-8e4d-1f7b502c3d4e" || ds[0].Members.All {
		t.Fatalf("channels %v all %v", got, ds[0].Members.All)
	}
	ds, ok, err = fanDecodeMessage([]byte(`{"t":"members","all":true}`))
	if err != nil || !ok || len(ds) != 1 || ds[0].Members == nil || !ds[0].Members.All {
		t.Fatalf("truncate message: %+v ok=%v err=%v", ds, ok, err)
	}
	if _, ok, err := fanDecodeMessage([]byte(`{"t":"members","channels":[]}`)); err == nil || ok {
		t.Fatalf("a members message naming nothing: ok=%v err=%v, want an error", ok, err)
	}
}
