package testenv

import (
	"bytes"
	"net"
	"net/url"
	"sync"
	"testing"
)

// TCPProxy forwards TCP connections to a target (a PostgreSQL server). Its path can go dead:
// BlackHole for good, Cut until Restore. While dead it forwards nothing in either direction,
// takes new connections without answering them, and keeps every socket open: the peers' reads
// wait instead of failing, as on a network path that went dead (a refused or reset connection
// would fail fast and test nothing). Restore resets every connection the dead path held (as the
// peers' TCP would, eventually) and forwards new ones again.
type TCPProxy struct {
	Addr   string // host:port to connect to instead of the target
	target string
	ln     net.Listener

	mu      sync.Mutex
	holed   bool       // for good
	cut     bool       // until Restore
	conns   []net.Conn // every socket, closed at Restore or at the test's cleanup
	trigger *trigger   // OnReply, CutOnReply
}

// trigger acts on the next server reply holding one of markers.
type trigger struct {
	markers [][]byte
	fn      func() // run before the reply is forwarded
	cut     bool   // then cut p and drop the reply
	fired   chan struct{}
}

// Markers for CutOnReply: a COMMIT's CommandComplete, and a CommandComplete's end followed by
// ReadyForQuery 'I' (an autocommit statement done: committed, if it wrote).
var (
	ReplyCommit    = []byte("COMMIT\x00")
	ReplyCommitted = []byte("\x00Z\x00\x00\x00\x05I")
)

// StartTCPProxy listens on a free loopback port and forwards to target (host:port).
func StartTCPProxy(t testing.TB, target string) *TCPProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &TCPProxy{Addr: ln.Addr().String(), target: target, ln: ln}
	t.Cleanup(p.close)
	go p.accept()
	return p
}

// ProxyURL is dbURL with its host and port replaced by p's address.
func (p *TCPProxy) ProxyURL(t testing.TB, dbURL string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = p.Addr
	return u.String()
}

// TargetOf is the host:port of a PostgreSQL URL.
func TargetOf(t testing.TB, dbURL string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	if err != nil || u.Host == "" {
		t.Fatalf("no host:port in %q: %v", dbURL, err)
	}
	return u.Host
}

// BlackHole stops all traffic through p for good, keeping the sockets open.
func (p *TCPProxy) BlackHole() {
	p.mu.Lock()
	p.holed = true
	p.mu.Unlock()
}

// Cut stops all traffic through p until Restore, keeping the sockets open.
func (p *TCPProxy) Cut() {
	p.mu.Lock()
	p.cut = true
	p.mu.Unlock()
}

// CutOnReply cuts p as the next server reply holding one of markers passes, and drops that
// reply: with ReplyCommit or ReplyCommitted, the server has committed and the client never
// learns. The returned channel is closed when the cut happened.
func (p *TCPProxy) CutOnReply(markers ...[]byte) <-chan struct{} {
	return p.arm(&trigger{markers: markers, cut: true})
}

// OnReply calls fn as the next server reply holding one of markers arrives, before forwarding it:
// fn may stop the client (SIGSTOP), which then reads the reply only when it wakes. The returned
// channel is closed once fn returned.
func (p *TCPProxy) OnReply(fn func(), markers ...[]byte) <-chan struct{} {
	return p.arm(&trigger{markers: markers, fn: fn})
}

func (p *TCPProxy) arm(tr *trigger) <-chan struct{} {
	tr.fired = make(chan struct{})
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.trigger != nil {
		close(p.trigger.fired)
	}
	p.trigger = tr
	return tr.fired
}

// Disarm drops a pending OnReply or CutOnReply.
func (p *TCPProxy) Disarm() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.trigger != nil {
		close(p.trigger.fired)
		p.trigger = nil
	}
}

// Restore resets every connection p holds (their peers see the reset and reconnect) and forwards
// new connections again. A pending CutOnReply is dropped.
func (p *TCPProxy) Restore() {
	p.mu.Lock()
	old := p.conns
	p.conns = nil
	p.cut = false
	if p.trigger != nil {
		close(p.trigger.fired)
		p.trigger = nil
	}
	p.mu.Unlock()
	for _, c := range old {
		_ = c.Close()
	}
}

func (p *TCPProxy) dead() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holed || p.cut
}

// keep records c, to be reset at Restore or closed at cleanup.
func (p *TCPProxy) keep(c net.Conn) {
	p.mu.Lock()
	p.conns = append(p.conns, c)
	p.mu.Unlock()
}

func (p *TCPProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed at cleanup
		}
		p.keep(c)
		if p.dead() {
			continue // accepted, never answered (reset at Restore)
		}
		go p.forward(c)
	}
}

func (p *TCPProxy) forward(c net.Conn) {
	s, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = c.Close()
		return
	}
	p.keep(s)
	go p.pipe(s, c, false)
	p.pipe(c, s, true)
}

// fire runs a trigger chunk, a server reply, trips; it reports whether p is now cut.
func (p *TCPProxy) fire(chunk []byte) bool {
	p.mu.Lock()
	tr := p.trigger
	hit := false
	for _, m := range trMarkers(tr) {
		hit = hit || bytes.Contains(chunk, m)
	}
	if !hit {
		p.mu.Unlock()
		return false
	}
	p.trigger = nil
	p.cut = p.cut || tr.cut
	p.mu.Unlock()
	if tr.fn != nil {
		tr.fn()
	}
	close(tr.fired)
	return tr.cut
}

func trMarkers(tr *trigger) [][]byte {
	if tr == nil {
		return nil
	}
	return tr.markers
}

// pipe copies src to dst until either fails or p goes dead; it never closes a socket, so a dead
// path leaves both ends open with nobody reading them. reply: src is the server.
func (p *TCPProxy) pipe(dst, src net.Conn, reply bool) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if p.dead() || (reply && n > 0 && p.fire(buf[:n])) {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			// A peer that went away (while the path was alive): pass the end on as a half close.
			if tc, ok := dst.(*net.TCPConn); ok {
				_ = tc.CloseWrite()
			}
			return
		}
	}
}

func (p *TCPProxy) close() {
	p.BlackHole()
	_ = p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
}
