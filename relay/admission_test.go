package relay

import (
	"net/http"
	"net/netip"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// dialStatus dials and returns the HTTP status of a refused upgrade (0 when it was accepted).
func dialStatus(t *testing.T, tr *testRelay) (int, http.Header) {
	t.Helper()
	ws, resp, err := websocket.DefaultDialer.Dial(tr.url, nil)
	if err == nil {
		ws.Close()
		t.Fatal("upgrade accepted over the cap")
	}
	if resp == nil {
		t.Fatalf("dial: %v", err)
	}
	return resp.StatusCode, resp.Header
}

// Connection caps: past MaxConnsPerIP one address gets 429, past MaxConns everyone gets 503, both
// with Retry-After and before any upgrade; a closed connection gives its slot back.
func TestConnectionCaps(t *testing.T) {
	t.Run("per address", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) { c.MaxConnsPerIP = 2 })
		a := tr.dial(t)
		tr.dial(t)
		before := testutil.ToFloat64(metrics.ConnectionsRefused.WithLabelValues("per_ip"))
		if code, h := dialStatus(t, tr); code != http.StatusTooManyRequests || h.Get("Retry-After") == "" {
			t.Fatalf("third connection from one address: %d %v, want 429 with Retry-After", code, h)
		}
		if d := testutil.ToFloat64(metrics.ConnectionsRefused.WithLabelValues("per_ip")) - before; d != 1 {
			t.Fatalf("buzz_connections_refused_total{reason=per_ip} moved by %v, want 1", d)
		}
		a.ws.Close()
		testenv.WaitUntil(t, 10*time.Second, "the closed connection torn down", func() bool { return tr.s.ConnCount() == 1 })
		tr.dial(t) // its slot is free again
	})
	t.Run("relay full", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) { c.MaxConns = 2 })
		tr.dial(t)
		b := tr.dial(t)
		if code, h := dialStatus(t, tr); code != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
			t.Fatalf("connection over MaxConns: %d %v, want 503 with Retry-After", code, h)
		}
		b.ws.Close()
		testenv.WaitUntil(t, 10*time.Second, "the closed connection torn down", func() bool { return tr.s.ConnCount() == 1 })
		c := tr.dial(t)
		sk, _ := testenv.NewKey()
		c.mustPublish(signed(sk, 1, "in", nostr.Now())) // a working connection, not just an upgrade
	})
}

// Behind a trusted load balancer the per-IP cap counts the X-Forwarded-For client, not the
// balancer; a peer that is not trusted cannot pick its own address with the header.
func TestConnectionCapsBehindAProxy(t *testing.T) {
	dialAs := func(tr *testRelay, xff string) (*websocket.Conn, int) {
		t.Helper()
		ws, resp, err := websocket.DefaultDialer.Dial(tr.url, http.Header{"X-Forwarded-For": {xff}})
		if err == nil {
			t.Cleanup(func() { ws.Close() })
			return ws, 0
		}
		if resp == nil {
			t.Fatalf("dial: %v", err)
		}
		return nil, resp.StatusCode
	}
	t.Run("trusted", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) {
			c.MaxConnsPerIP = 1
			c.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
		})
		if _, code := dialAs(tr, "198.51.100.1"); code != 0 {
			t.Fatalf("first client behind the proxy: %d", code)
		}
		if _, code := dialAs(tr, "198.51.100.2"); code != 0 {
			t.Fatalf("another client behind the same proxy: %d, want admitted", code)
		}
		// A client-written entry left of the one the proxy appended is not believed.
		if _, code := dialAs(tr, "203.0.113.9, 198.51.100.1"); code != http.StatusTooManyRequests {
			t.Fatalf("a second connection of 198.51.100.1 with a forged entry in front: %d, want 429", code)
		}
		// IPv6 counts by /64, the block one host is usually given: another address in it is the
		// same client, an address in the next /64 another one.
		if _, code := dialAs(tr, "2001:db8:1:2::1"); code != 0 {
			t.Fatalf("first IPv6 client: %d", code)
		}
		if _, code := dialAs(tr, "2001:db8:1:2:ffff::9"); code != http.StatusTooManyRequests {
			t.Fatalf("another address in the same /64: %d, want 429", code)
		}
		if _, code := dialAs(tr, "2001:db8:1:3::1"); code != 0 {
			t.Fatalf("an address in the next /64: %d, want admitted", code)
		}
	})
	t.Run("untrusted peer", func(t *testing.T) {
		tr := startRelay(t, func(c *Config) { c.MaxConnsPerIP = 1 })
		if _, code := dialAs(tr, "198.51.100.1"); code != 0 {
			t.Fatalf("first connection: %d", code)
		}
		if _, code := dialAs(tr, "198.51.100.2"); code != http.StatusTooManyRequests {
			t.Fatalf("a second connection from the same peer with another X-Forwarded-For: %d, want 429", code)
		}
	})
}

func TestClientIP(t *testing.T) {
	s := &Server{cfg: Config{TrustedProxies: []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("2001:db8::/32")}}}
	for _, c := range []struct{ remote, xff, want string }{
		{"192.0.2.7:5000", "198.51.100.1", "192.0.2.7"},                 // untrusted peer: header ignored
		{"10.1.2.3:5000", "", "10.1.2.3"},                               // trusted peer, no header
		{"10.1.2.3:5000", "198.51.100.1", "198.51.100.1"},               // one proxy
		{"10.1.2.3:5000", "198.51.100.9, 198.51.100.1", "198.51.100.1"}, // forged left entry
		{"10.1.2.3:5000", "198.51.100.1, 10.9.9.9", "198.51.100.1"},     // two proxies
		{"10.1.2.3:5000", "10.9.9.9, 10.8.8.8", "10.9.9.9"},             // only proxies
		{"10.1.2.3:5000", "junk, 10.8.8.8", "10.8.8.8"},                 // garbage: the last sane hop
		{"10.1.2.3:5000", "198.51.100.1:61000", "198.51.100.1"},         // address:port
		{"10.1.2.3:5000", "[2001:db9::5]:443, 10.8.8.8", "2001:db9::5"},
		{"[2001:db8::1]:5000", "::ffff:198.51.100.1", "198.51.100.1"}, // v6 proxy, mapped client
	} {
		r := &http.Request{RemoteAddr: c.remote, Header: http.Header{}}
		if c.xff != "" {
			r.Header.Set("X-Forwarded-For", c.xff)
		}
		if got := s.clientIP(r); got != c.want {
			t.Errorf("clientIP(%s, XFF %q) = %s, want %s", c.remote, c.xff, got, c.want)
		}
	}
}
