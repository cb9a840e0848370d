package relay

import (
	"net/http"
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
