package bench

import (
	"math"
	"strings"
	"testing"
	"time"
)

// soakWith is a 20-minute soak's samples, one a minute, where size(t, minute) gives each hot
// table's size in kB.
func soakWith(size func(t string, minute int) int64) *soak {
	cfg := &Config{Duration: 20 * time.Minute}
	s := &soak{cfg: cfg, res: newResult("soak", cfg)}
	for m := 0; m <= 20; m++ {
		sm := soakSample{at: time.Duration(m) * time.Minute, total: map[string]int64{}}
		for _, t := range soakTables {
			sm.total[t] = size(t, m) << 10
		}
		s.samples = append(s.samples, sm)
	}
	return s
}

// The verdict compares minute 5 with minute 20 (a 20-minute run's warm-up is 5 minutes): growth
// before minute 5 does not count, 10% after it fails.
func TestSoakVerdictComparesMinute5WithMinute20(t *testing.T) {
	t.Setenv("BUZZ_UPKEEP_INTERVAL", "15s")
	warm := soakWith(func(_ string, m int) int64 { return 1000 * int64(min(m, 5)) })
	if err := warm.check(); err != nil {
		t.Errorf("tables that grew only before minute 5: %v", err)
	}
	grown := soakWith(func(tb string, m int) int64 {
		if tb == "reminders" && m == 20 {
			return 1200 // +20% of minute 5's 1000 kB, past 10% plus the 64 kB a first vacuum may add
		}
		return 1000
	})
	if err := grown.check(); err == nil || !strings.Contains(err.Error(), "reminders grew") {
		t.Errorf("reminders 1000 kB at minute 5, 1200 kB at minute 20: err %v, want a failure naming reminders", err)
	}
}

// trend reports the range and slope from the warm-up on: a table sawing between two sizes has a
// slope near 0 (under 1 kB/min), one gaining 4 kB a minute a slope of 4.
func TestSoakTrend(t *testing.T) {
	s := soakWith(func(tb string, m int) int64 {
		switch {
		case tb == "reminders":
			return 800 + 4*int64(m)
		case m%2 == 0:
			return 160
		default:
			return 240
		}
	})
	if lo, hi, slope := s.trend("reminders"); lo != 820<<10 || hi != 880<<10 || math.Abs(slope-4) > 1e-9 {
		t.Errorf("reminders: %d-%d kB, slope %v; want 820-880, 4", lo>>10, hi>>10, slope)
	}
	if lo, hi, slope := s.trend("visibility_outbox"); lo != 160<<10 || hi != 240<<10 || math.Abs(slope) > 1 {
		t.Errorf("outbox: %d-%d kB, slope %v; want 160-240, about 0", lo>>10, hi>>10, slope)
	}
}
