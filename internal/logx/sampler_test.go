package logx

import (
	"testing"
	"time"
)

func TestSamplerFoldsWithinAnInterval(t *testing.T) {
	s := Sampler{Every: 10 * time.Second}
	t0 := time.Unix(1000, 0)
	steps := []struct {
		at     time.Duration
		ok     bool
		folded int
	}{
		{0, true, 0},                   // the first line goes out
		{time.Second, false, 0},        // held back
		{9 * time.Second, false, 0},    // held back
		{10 * time.Second, true, 2},    // an interval later: out, saying two were folded
		{10*time.Second + 1, false, 0}, // held back again
		{time.Minute, true, 1},         // and so on
		{2 * time.Minute, true, 0},     // quiet meanwhile: nothing folded
	}
	for i, st := range steps {
		ok, folded := s.Allow(t0.Add(st.at))
		if ok != st.ok || folded != st.folded {
			t.Fatalf("step %d at +%s: Allow = %v, %d; want %v, %d", i, st.at, ok, folded, st.ok, st.folded)
		}
	}
}
