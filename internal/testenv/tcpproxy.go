package testenv

import (
	"net"
	"net/url"
	"sync"
	"testing"
)

// TCPProxy forwards TCP connections to a target (a PostgreSQL server) until BlackHole. From then on
// it forwards nothing in either direction and reads nothing, takes new connections without
// answering them, and keeps every socket open: the peers' reads wait instead of failing, as on a
// network path that went dead (a refused or reset connection would fail fast and test nothing).
type TCPProxy struct {
	Addr   string // host:port to connect to instead of the target
	target string
	ln     net.Listener
	holed  chan struct{}
	once   sync.Once

	mu    sync.Mutex
	conns []net.Conn // every socket, closed at the test's cleanup
}

// StartTCPProxy listens on a free loopback port and forwards to target (host:port).
func StartTCPProxy(t testing.TB, target string) *TCPProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &TCPProxy{Addr: ln.Addr().String(), target: target, ln: ln, holed: make(chan struct{})}
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
func (p *TCPProxy) BlackHole() { p.once.Do(func() { close(p.holed) }) }

func (p *TCPProxy) isHoled() bool {
	select {
	case <-p.holed:
		return true
	default:
		return false
	}
}

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
		if p.isHoled() {
			continue // accepted, never answered
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
	go p.pipe(s, c)
	p.pipe(c, s)
}

// pipe copies src to dst until either fails or p is black-holed; it never closes a socket, so a
// hole leaves both ends open with nobody reading them.
func (p *TCPProxy) pipe(dst, src net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if p.isHoled() {
			return
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			// A peer that went away (before any hole): pass the end on as a half close.
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
