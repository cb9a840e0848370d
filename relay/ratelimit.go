package relay

import (
	"net"
	"net/netip"
	"strings"

	"net/http"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// tokenBucket is a classic token bucket; rate 0 means unlimited. Not safe for concurrent use
// (per-connection buckets are only touched by the read loop; per-IP buckets are under ipLimiter.mu).
type tokenBucket struct {
	rate   float64
	burst  float64
	tokens float64
	last   time.Time
}

func newTokenBucket(rate float64, burst int) *tokenBucket {
	if burst < 1 {
		burst = 1
	}
	return &tokenBucket{rate: rate, burst: float64(burst), tokens: float64(burst)}
}

func (b *tokenBucket) allow(now time.Time) bool {
	if b == nil || b.rate <= 0 {
		return true
	}
	if !b.last.IsZero() {
		b.tokens += now.Sub(b.last).Seconds() * b.rate
		if b.tokens > b.burst {
			b.tokens = b.burst
		}
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// ipLimiter shares buckets among all connections of one client IP, so opening more connections
// does not multiply a client's budget. Idle buckets are dropped lazily.
type ipLimiter struct {
	rate    float64
	burst   int
	mu      sync.Mutex
	buckets map[string]*tokenBucket
	swept   time.Time
}

func newIPLimiter(rate float64, burst int) *ipLimiter {
	if rate <= 0 {
		return nil
	}
	return &ipLimiter{rate: rate, burst: burst, buckets: map[string]*tokenBucket{}}
}

func (l *ipLimiter) allow(ip string, now time.Time) bool {
	if l == nil {
		return true
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.swept) > time.Minute {
		// A bucket idle long enough to be full again is the same as no bucket.
		for k, b := range l.buckets {
			if now.Sub(b.last).Seconds()*l.rate >= b.burst {
				delete(l.buckets, k)
			}
		}
		l.swept = now
	}
	b := l.buckets[ip]
	if b == nil {
		b = newTokenBucket(l.rate, l.burst)
		l.buckets[ip] = b
	}
	return b.allow(now)
}

// clientIP is the address the per-IP caps and rate limits count. It is the TCP peer, unless the
// peer is one of cfg.TrustedProxies (a load balancer): then it is the rightmost X-Forwarded-For
// entry that is not a trusted proxy, the address the outermost trusted proxy saw. Entries to the
// left of it are whatever the client wrote and are never believed; without trusted proxies the
// header is ignored, so a client cannot use it to escape its budget. Trusted proxies must be the
// balancers only: a client inside a trusted range is taken for a proxy, and the entries it
// writes in front of its own address would be believed.
func (s *Server) clientIP(r *http.Request) string {
	peer, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		peer = r.RemoteAddr
	}
	addr, err := netip.ParseAddr(peer)
	if err != nil || !s.trustedProxy(addr) {
		return peer
	}
	hops := strings.Split(strings.Join(r.Header.Values("X-Forwarded-For"), ","), ",")
	for i := len(hops) - 1; i >= 0; i-- {
		hop, ok := parseHop(strings.TrimSpace(hops[i]))
		if !ok {
			break // garbage from here leftwards: count the last proxy that wrote something sane
		}
		addr = hop.Unmap()
		if !s.trustedProxy(addr) {
			return addr.String()
		}
	}
	return addr.String()
}

// limitKey is what per-IP caps and rates count for a client address: the address itself, or for
// IPv6 its /64. One host is commonly given a whole /64, so counting addresses would let it open
// as many "clients" as it likes.
func limitKey(ip string) string {
	a, err := netip.ParseAddr(ip)
	if err != nil || a.Unmap().Is4() {
		return ip
	}
	p, err := a.Prefix(64)
	if err != nil {
		return ip
	}
	return p.String()
}

// parseHop reads one X-Forwarded-For entry: an address, or address:port as some balancers write it.
func parseHop(h string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(h); err == nil {
		return a, true
	}
	if ap, err := netip.ParseAddrPort(h); err == nil {
		return ap.Addr(), true
	}
	return netip.Addr{}, false
}

func (s *Server) trustedProxy(a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range s.cfg.TrustedProxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// allowEvent charges EVENT and AUTH alike: each costs a signature check.
func (c *conn) allowEvent(verb string) bool {
	now := timeNow()
	if !c.eventBucket.allow(now) || !c.s.ipEvents.allow(c.ip, now) {
		metrics.RateLimited.WithLabelValues(verb).Inc()
		c.limited()
		return false
	}
	c.limitedStreak = 0
	return true
}

func (c *conn) allowReq(verb string) bool {
	now := timeNow()
	if !c.reqBucket.allow(now) || !c.s.ipReqs.allow(c.ip, now) {
		metrics.RateLimited.WithLabelValues(verb).Inc()
		c.limited()
		return false
	}
	c.limitedStreak = 0
	return true
}

// limited counts consecutive refusals. A client that keeps sending while every message is
// refused is not backing off: each refusal is cheap but not free, so after maxLimitedStreak in a
// row it is told and disconnected (read loop only, like the buckets).
func (c *conn) limited() {
	c.limitedStreak++
	if c.limitedStreak == maxLimitedStreak {
		c.log.Warn("closing a client that ignores rate limits", "refused_in_a_row", c.limitedStreak)
		c.closeGracefully(websocket.ClosePolicyViolation, "rate limit ignored",
			"rate-limited: too many messages over the limit, closing")
	}
}
