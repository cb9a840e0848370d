package testenv

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// RowCut breaks a pool's connection the way a network fault or a proxy dropping it would, at a
// point of the wire protocol a test cannot reach otherwise: right after the first DataRow of a
// statement whose SQL contains a marker has reached the client, and before anything after it
// (more rows, CommandComplete, ReadyForQuery). It dials the real server and closes that socket,
// so PostgreSQL sees its client gone too; the client sees a connection reset.
//
// pgx answers a broken connection with a cancel request for its backend, which aborts the
// statement if it is still running; DropCancels makes the cut lose that request too, as a
// network fault between client and server would.
//
// It reads the protocol in the clear, so its pools never use TLS.
type RowCut struct {
	marker      string
	armed       atomic.Bool
	dropCancels atomic.Bool
	cut         chan struct{}

	mu      sync.Mutex
	severed map[uint32]bool // backend pids of the connections cut
}

// NewRowCut returns a cutter for statements containing marker, armed for one cut.
func NewRowCut(marker string) *RowCut {
	c := &RowCut{marker: marker, cut: make(chan struct{}), severed: map[uint32]bool{}}
	c.armed.Store(true)
	return c
}

// DropCancels makes the cut also lose the cancel requests for the backend it cut off.
func (c *RowCut) DropCancels() { c.dropCancels.Store(true) }

// Cut is closed once the cut happened.
func (c *RowCut) Cut() <-chan struct{} { return c.cut }

// Pool is a pool to url whose connections go through c.
func (c *RowCut) Pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.TLSConfig = nil
	cfg.ConnConfig.Fallbacks = nil
	cfg.ConnConfig.DialFunc = c.dial
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func (c *RowCut) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &rowCutConn{Conn: conn, c: c, stmts: map[string]bool{}, fe: frames{untyped: true}}, nil
}

// rowCutConn follows both directions message by message: the client's Parse, Bind and Query say
// which statement the rows that come back belong to.
type rowCutConn struct {
	net.Conn
	c *RowCut

	mu      sync.Mutex
	fe, be  frames
	stmts   map[string]bool // prepared statement name -> its SQL contains the marker
	current bool            // the statement executing contains the marker
	pid     uint32          // the backend's, from BackendKeyData
	dead    bool
}

var errCut = &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}

func (r *rowCutConn) Write(p []byte) (int, error) {
	r.mu.Lock()
	dead := r.dead
	r.mu.Unlock()
	if dead {
		return 0, &net.OpError{Op: "write", Net: "tcp", Err: syscall.EPIPE}
	}
	r.mu.Lock()
	drop := false
	r.fe.feed(p, func(typ byte) bool { return typ == 0 || typ == 'P' || typ == 'B' || typ == 'Q' },
		func(typ byte, body []byte, _ int) bool {
			s := cstrings(body)
			switch {
			case typ == 0: // the first message: startup, or a cancel request (code, pid, key)
				drop = len(body) >= 8 && binary.BigEndian.Uint32(body) == cancelRequestCode &&
					r.c.dropCancels.Load() && r.c.wasSevered(binary.BigEndian.Uint32(body[4:]))
			case typ == 'P' && len(s) >= 2: // statement name, SQL
				r.stmts[s[0]] = strings.Contains(s[1], r.c.marker)
			case typ == 'B' && len(s) >= 2: // portal, statement name
				r.current = r.stmts[s[1]]
			case typ == 'Q' && len(s) >= 1:
				r.current = strings.Contains(s[0], r.c.marker)
			}
			return false
		})
	r.mu.Unlock()
	if drop {
		_ = r.Conn.Close()
		return len(p), nil
	}
	return r.Conn.Write(p)
}

const cancelRequestCode = 80877102

func (c *RowCut) wasSevered(pid uint32) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.severed[pid]
}

func (r *rowCutConn) Read(p []byte) (int, error) {
	r.mu.Lock()
	if r.dead {
		r.mu.Unlock()
		return 0, errCut
	}
	r.mu.Unlock()
	n, err := r.Conn.Read(p)
	r.mu.Lock()
	defer r.mu.Unlock()
	cutAt := -1
	r.be.feed(p[:n], func(typ byte) bool { return typ == 'K' }, func(typ byte, body []byte, end int) bool {
		if typ == 'K' && len(body) >= 4 {
			r.pid = binary.BigEndian.Uint32(body)
		}
		if typ == 'D' && r.current && r.c.armed.CompareAndSwap(true, false) {
			cutAt = end
			return true
		}
		return false
	})
	if cutAt < 0 {
		return n, err
	}
	r.dead = true
	_ = r.Conn.Close()
	r.c.mu.Lock()
	r.c.severed[r.pid] = true
	r.c.mu.Unlock()
	close(r.c.cut)
	return cutAt, nil
}

// frames splits a protocol byte stream into messages: a type byte (none for the client's first
// message, the startup packet), a length that counts itself, the body.
type frames struct {
	untyped bool
	hdr     []byte
	typ     byte
	left    int
	inBody  bool
	keep    bool
	body    []byte
}

// feed consumes b; done gets each complete message (the body only where keep said so) and the
// offset in b just after it, and stops the feed by returning true.
func (f *frames) feed(b []byte, keep func(byte) bool, done func(typ byte, body []byte, end int) bool) {
	for i := 0; i < len(b); {
		if !f.inBody {
			need := 5
			if f.untyped {
				need = 4
			}
			k := min(need-len(f.hdr), len(b)-i)
			f.hdr = append(f.hdr, b[i:i+k]...)
			i += k
			if len(f.hdr) < need {
				return
			}
			f.typ = 0
			if !f.untyped {
				f.typ = f.hdr[0]
			}
			f.left = int(binary.BigEndian.Uint32(f.hdr[need-4:])) - 4
			f.keep = keep(f.typ)
			f.body = f.body[:0]
			f.inBody = true
		}
		k := min(f.left, len(b)-i)
		if f.keep {
			f.body = append(f.body, b[i:i+k]...)
		}
		f.left -= k
		i += k
		if f.left > 0 {
			return
		}
		f.inBody, f.untyped, f.hdr = false, false, f.hdr[:0]
		if done(f.typ, f.body, i) {
			return
		}
	}
}

// cstrings splits a message body into its NUL-terminated strings (as far as it has any).
func cstrings(b []byte) []string {
	var out []string
	for {
		i := bytes.IndexByte(b, 0)
		if i < 0 {
			return out
		}
		out = append(out, string(b[:i]))
		b = b[i+1:]
	}
}
