// Package logx holds what log/slog does not: a sampler for lines that fire once per event.
package logx

import (
	"sync"
	"time"
)

// Sampler lets one line through per interval and counts the ones it holds back, so an outage
// that fails every event logs once per interval with how many it folded, not once per event
// (at 1,000 events/s that is the difference between one line and a full disk).
type Sampler struct {
	Every time.Duration

	mu     sync.Mutex
	last   time.Time
	folded int
}

// Allow reports whether to log now, and how many lines were held back since the last one.
func (s *Sampler) Allow(now time.Time) (ok bool, folded int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.last.IsZero() && now.Sub(s.last) < s.Every {
		s.folded++
		return false, 0
	}
	folded, s.folded = s.folded, 0
	s.last = now
	return true, folded
}
