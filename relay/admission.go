package relay

import (
	"net/http"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// Connection caps bound what the relay can hold at once: each connection may own a send queue
// (SendQueueBytes) and initial query results (maxInitialBytes per query), so without a cap a
// crowd of clients, or one client opening connections in a loop, decides the process's memory.
// A slot is taken before the WebSocket upgrade, so a refusal is a plain HTTP answer that costs
// the relay nothing, and given back when the connection is torn down.

// admit takes a connection slot for ip; it answers the refusal itself and reports false when
// there is none.
func (s *Server) admit(w http.ResponseWriter, ip string) bool {
	s.mu.Lock()
	total, mine := s.admitted, s.perIP[ip]
	ok := total < s.cfg.MaxConns && mine < s.cfg.MaxConnsPerIP
	if ok {
		s.admitted++
		s.perIP[ip] = mine + 1
	}
	s.mu.Unlock()
	if ok {
		return true
	}
	w.Header().Set("Retry-After", "5")
	if total >= s.cfg.MaxConns {
		metrics.ConnectionsRefused.WithLabelValues("relay_full").Inc()
		http.Error(w, "relay full: too many open connections, try again later", http.StatusServiceUnavailable)
	} else {
		metrics.ConnectionsRefused.WithLabelValues("per_ip").Inc()
		http.Error(w, "too many open connections from your address", http.StatusTooManyRequests)
	}
	return false
}

// unadmit gives a slot back (the connection is gone, or never got past the upgrade).
func (s *Server) unadmit(ip string) {
	s.mu.Lock()
	s.admitted--
	if s.perIP[ip]--; s.perIP[ip] <= 0 {
		delete(s.perIP, ip)
	}
	s.mu.Unlock()
}
