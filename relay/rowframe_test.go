package relay

import (
	"bytes"
	"context"
	"encoding/binary"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// trickyStrings are contents whose JSON needs care: every escape easyjson writes, UTF-8 it keeps,
// and bytes that are not UTF-8 (PostgreSQL text never holds them, but the writer must not care).
var trickyStrings = []string{
	"", "plain", `"quoted"`, `back\slash`, "\\\"", "tab\tcr\rnl\n", "\x00\x01\x07\x08\x0b\x0c\x1b\x1f",
	"\x7f del", "<html>&amp;</html>", "line\u2028sep\u2029para", "emoji 🎉👍🏽", "ñandú Ω 中文",
	"\ufffd literal", "\xff\xfe lone", "trunc \xe2\x82", "\xed\xa0\x80 surrogate", "\xc0\x80 overlong",
	"end \xe2\x80\xa8", strings.Repeat("a", 300) + "\"" + strings.Repeat("é", 50),
	"/ solidus \u00a0 nbsp \u200b zwsp \U0010ffff max",
}

// easyjsonString is what clients got before: easyjson's writer as newWriter configures it.
func easyjsonString(s string) []byte {
	w := newWriter()
	w.String(s)
	b, _ := w.BuildBytes()
	return b
}

func TestAppendJSONStringMatchesEasyjson(t *testing.T) {
	for _, s := range trickyStrings {
		got := appendJSONString([]byte("x"), []byte(s))
		if want := append([]byte("x"), easyjsonString(s)...); !bytes.Equal(got, want) {
			t.Errorf("%q: got %s, want %s", s, got, want)
		}
	}
	for c := 0; c < 256; c++ { // every single byte, at every place of an eight-byte word
		for at := 0; at < 18; at++ {
			b := []byte(strings.Repeat("abcdefgh", 3)[:18])
			b[at] = byte(c)
			if got, want := appendJSONString(nil, b), easyjsonString(string(b)); !bytes.Equal(got, want) {
				t.Errorf("byte %#x at %d: got %s, want %s", c, at, got, want)
			}
		}
	}
}

func FuzzJSONString(f *testing.F) {
	for _, s := range trickyStrings {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if got, want := appendJSONString(nil, []byte(s)), easyjsonString(s); !bytes.Equal(got, want) {
			t.Fatalf("%q: got %s, want %s", s, got, want)
		}
	})
}

// storedEventJSONBefore is how a stored row became the event's JSON before rowFrame.
func storedEventJSONBefore(ev *nostr.Event, tagsJSON string) []byte {
	w := newWriter()
	writeEventHead(w, ev)
	w.RawString(`,"tags":`)
	w.RawString(tagsJSON)
	w.RawString(`,"content":`)
	return finishEvent(w, ev)
}

// rawRow is a stored row as pgx hands it over: ints in binary or in text.
func rawRow(ev *nostr.Event, tags string, format int16) ([][]byte, []pgconn.FieldDescription) {
	fds := make([]pgconn.FieldDescription, rowCols)
	for i := range fds {
		fds[i].Name = "c" + strconv.Itoa(i)
	}
	vals := make([][]byte, rowCols)
	vals[colID], vals[colPubKey], vals[colSig] = []byte(ev.ID), []byte(ev.PubKey), []byte(ev.Sig)
	vals[colTags], vals[colContent] = []byte(tags), []byte(ev.Content)
	if format == pgx.BinaryFormatCode {
		vals[colCreatedAt] = binary.BigEndian.AppendUint64(nil, uint64(ev.CreatedAt))
		vals[colKind] = binary.BigEndian.AppendUint32(nil, uint32(ev.Kind))
	} else {
		vals[colCreatedAt] = strconv.AppendInt(nil, int64(ev.CreatedAt), 10)
		vals[colKind] = strconv.AppendInt(nil, int64(ev.Kind), 10)
	}
	fds[colCreatedAt].Format, fds[colKind].Format = format, format
	return vals, fds
}

// A row's frame is byte for byte the message built the old way, and the length it reports is
// the event JSON's, which the budgets counted before.
func TestRowFrameMatchesEventMessage(t *testing.T) {
	prefix := eventPrefix("sub \"1\"")
	tags := `[["t", "x"], ["e", "` + strings.Repeat("a", 64) + `", "wss://r", "reply"]]`
	for _, content := range trickyStrings {
		for _, format := range []int16{pgx.BinaryFormatCode, pgx.TextFormatCode} {
			ev := nostr.Event{ID: strings.Repeat("ab", 32), PubKey: strings.Repeat("0f", 32), CreatedAt: 1733200000,
				Kind: 30023, Content: content, Sig: strings.Repeat("9c", 64)}
			js := storedEventJSONBefore(&ev, tags)
			vals, fds := rawRow(&ev, tags, format)
			msg, n, err := rowFrame(nil, prefix, vals, fds)
			if err != nil {
				t.Fatal(err)
			}
			if want := eventMessage(prefix, js); !bytes.Equal(msg, want) || n != len(js) {
				t.Fatalf("content %q format %d:\n got %s (%d)\nwant %s (%d)", content, format, msg, n, want, len(js))
			}
		}
	}
	ev := nostr.Event{ID: "x", Kind: -1, CreatedAt: -5}
	vals, fds := rawRow(&ev, "[]", pgx.BinaryFormatCode)
	if msg, _, _ := rowFrame(nil, prefix, vals, fds); !bytes.Equal(msg, eventMessage(prefix, storedEventJSONBefore(&ev, "[]"))) {
		t.Fatalf("negative numbers: %s", msg)
	}
	vals[colSig] = nil
	if _, _, err := rowFrame(nil, prefix, vals, fds); err == nil {
		t.Fatal("a NULL column gave no error")
	}
}

// BenchmarkRowFrame: one stored row (200 bytes of content, one tag) to its EVENT message, as
// rowFrame builds it and as it was built before (Scan into strings, easyjson, then the message).
//
//	go test ./relay -run '^$' -bench RowFrame -benchmem
func BenchmarkRowFrame(b *testing.B) {
	prefix := eventPrefix("q1")
	tags := `[["t", "relayload-7"]]`
	ev := nostr.Event{ID: strings.Repeat("ab", 32), PubKey: strings.Repeat("0f", 32), CreatedAt: 1733200000,
		Kind: 1, Content: strings.Repeat("relayload benchmark event 0123456789 ", 6)[:200], Sig: strings.Repeat("9c", 64)}
	vals, fds := rawRow(&ev, tags, pgx.BinaryFormatCode)
	b.Run("rowFrame", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if _, _, err := rowFrame(make([]byte, 0, rowFrameSize(prefix, vals)), prefix, vals, fds); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("before", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			var e nostr.Event // what Scan allocated: a string per text column
			e.ID, e.PubKey, e.Content, e.Sig = string(vals[colID]), string(vals[colPubKey]), string(vals[colContent]), string(vals[colSig])
			tagText := string(vals[colTags])
			e.CreatedAt, e.Kind = ev.CreatedAt, ev.Kind
			_ = eventMessage(prefix, storedEventJSONBefore(&e, tagText))
		}
	})
}

// Through PostgreSQL: an initial answer's frames are byte for byte what the old path built from
// the same row (tags as jsonb text), for content that needs every kind of care.
func TestInitialRowFramesByteIdentical(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, _ := testenv.NewKey()
	var want []nostr.Event
	for i, content := range []string{"tab\tquote\" back\\ nl\n", "\x01\x1f ctl", "sep\u2028\u2029", "emoji 🎉 ñ 中", "\ufffd", `{"json":[1,"x"]}`} {
		ev := signed(sk, 1, content, nostr.Timestamp(1733200000+i), nostr.Tag{"t", "rowframe"}, nostr.Tag{"alt", "a \"b\" \\c\u2028"})
		c.mustPublish(ev)
		want = append([]nostr.Event{ev}, want...) // newest first
	}
	c.sendJSON("REQ", "bytes", nostr.Filter{Tags: nostr.TagMap{"t": {"rowframe"}}, Limit: 10})
	for _, ev := range want {
		_, got, err := c.ws.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		var tags string
		if err := tr.pool.QueryRow(context.Background(), `SELECT tags::text FROM buzz.events WHERE id = $1`, ev.ID).Scan(&tags); err != nil {
			t.Fatal(err)
		}
		if exp := eventMessage(eventPrefix("bytes"), storedEventJSONBefore(&ev, tags)); !bytes.Equal(got, exp) {
			t.Fatalf("frame for %q:\n got %s\nwant %s", ev.Content, got, exp)
		}
	}
	if m := c.read(); c.verb(m) != "EOSE" {
		t.Fatalf("after the rows: %s", m)
	}
}
