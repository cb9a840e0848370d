package relay

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A stored row becomes its EVENT frame in one buffer, from the bytes pgx read: no strings per
// column, no writer chunks copied into the event's JSON, then into the message (a REQ of 100
// rows spent a fifth of the relay's CPU there and in the garbage it made, profiled). The bytes
// are those eventMessage(prefix, JSON) gave before, for every input (relay/rowframe_test.go).

// Columns of a stored row, as reqSQL selects them (selectCols).
const (
	colID = iota
	colPubKey
	colCreatedAt
	colKind
	colTags
	colContent
	colSig
	rowCols
)

// rowFrame appends the EVENT message of one stored row to dst: prefix (`["EVENT","<sub>",`),
// the event's JSON, `]`. It returns the message and the length of the event's JSON in it, what
// the budgets count. tags come as jsonb text, already JSON.
func rowFrame(dst, prefix []byte, vals [][]byte, fds []pgconn.FieldDescription) (msg []byte, jsonLen int, err error) {
	if len(vals) != rowCols || len(fds) != rowCols {
		return nil, 0, fmt.Errorf("stored row: %d columns, want %d", len(vals), rowCols)
	}
	for i, v := range vals {
		if v == nil {
			return nil, 0, fmt.Errorf("stored row: column %s is NULL", fds[i].Name)
		}
	}
	createdAt, err := rawInt(vals[colCreatedAt], fds[colCreatedAt].Format)
	if err != nil {
		return nil, 0, fmt.Errorf("stored row: created_at: %w", err)
	}
	kind, err := rawInt(vals[colKind], fds[colKind].Format)
	if err != nil {
		return nil, 0, fmt.Errorf("stored row: kind: %w", err)
	}
	b := append(dst, prefix...)
	start := len(b)
	b = append(b, `{"id":`...)
	b = appendJSONString(b, vals[colID])
	b = append(b, `,"pubkey":`...)
	b = appendJSONString(b, vals[colPubKey])
	b = append(b, `,"created_at":`...)
	b = strconv.AppendInt(b, createdAt, 10)
	b = append(b, `,"kind":`...)
	b = strconv.AppendInt(b, kind, 10)
	b = append(b, `,"tags":`...)
	b = append(b, vals[colTags]...)
	b = append(b, `,"content":`...)
	b = appendJSONString(b, vals[colContent])
	b = append(b, `,"sig":`...)
	b = appendJSONString(b, vals[colSig])
	b = append(b, '}')
	jsonLen = len(b) - start
	return append(b, ']'), jsonLen, nil
}

// rowFrameSize is about what rowFrame writes for vals: the capacity to start with, so that
// the message is one allocation unless content needs escapes.
func rowFrameSize(prefix []byte, vals [][]byte) int {
	n := len(prefix) + 96 // field names, numbers, quotes, braces
	for _, v := range vals {
		n += len(v)
	}
	return n
}

// rawInt reads an integer column in the format PostgreSQL sent it (binary: big-endian, 2, 4 or
// 8 bytes; text: decimal).
func rawInt(v []byte, format int16) (int64, error) {
	if format == pgx.TextFormatCode { // pgx's choice for a type it does not know in binary
		return strconv.ParseInt(string(v), 10, 64)
	}
	switch len(v) {
	case 8:
		return int64(binary.BigEndian.Uint64(v)), nil
	case 4:
		return int64(int32(binary.BigEndian.Uint32(v))), nil
	case 2:
		return int64(int16(binary.BigEndian.Uint16(v))), nil
	}
	return 0, fmt.Errorf("binary integer of %d bytes", len(v))
}

// jsonSafe marks the ASCII bytes a JSON string holds as they are: what easyjson's writer (with
// NoEscapeHTML, newWriter) leaves alone, so the bytes stay those clients got before.
var jsonSafe = func() (t [utf8.RuneSelf]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

const lowerHex = "0123456789abcdef"

// needsCare8 reports whether any of the eight bytes in w is not jsonSafe: a control character,
// '"', '\\', or a byte of a multi-byte (or invalid) UTF-8 sequence. Exact for "any" (the usual
// bit tricks: a byte below n, a byte equal to zero), which is all the caller asks.
func needsCare8(w uint64) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	ctl := (w - 0x20*ones) &^ w // a byte below 0x20 (bytes from 0x80 are caught by w itself)
	q := w ^ ('"' * ones)
	q = (q - ones) &^ q // a byte equal to '"'
	bs := w ^ ('\\' * ones)
	bs = (bs - ones) &^ bs // a byte equal to '\\'
	return (ctl|q|bs|w)&highs != 0
}

// appendJSONString appends s as a JSON string exactly as easyjson's jwriter.String writes it
// with NoEscapeHTML: \t \r \n \\ \" short, other control characters \u00XX, each byte of invalid
// UTF-8 \ufffd, U+2028 and U+2029 escaped, everything else (UTF-8 included) as it is.
func appendJSONString(dst, s []byte) []byte {
	dst = append(dst, '"')
	p := 0 // start of the run not yet appended
	for i := 0; i < len(s); {
		if i+8 <= len(s) && !needsCare8(binary.LittleEndian.Uint64(s[i:])) {
			i += 8 // hex fields and most text: eight bytes at a time
			continue
		}
		c := s[i]
		if c < utf8.RuneSelf {
			if jsonSafe[c] {
				i++
				continue
			}
			dst = append(dst, s[p:i]...)
			switch c {
			case '\t':
				dst = append(dst, '\\', 't')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\\', '"':
				dst = append(dst, '\\', c)
			default:
				dst = append(dst, '\\', 'u', '0', '0', lowerHex[c>>4], lowerHex[c&0xf])
			}
			i++
			p = i
			continue
		}
		r, w := utf8.DecodeRune(s[i:])
		switch {
		case r == utf8.RuneError && w == 1:
			dst = append(dst, s[p:i]...)
			dst = append(dst, `\ufffd`...)
		case r == '\u2028' || r == '\u2029':
			dst = append(dst, s[p:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', lowerHex[r&0xf])
		default:
			i += w
			continue
		}
		i += w
		p = i
	}
	dst = append(dst, s[p:]...)
	return append(dst, '"')
}
