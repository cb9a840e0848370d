package testenv

import (
	"os"
	"sort"
	"strconv"
	"time"
)

// Percentiles returns p50, p99 and the maximum of ds (zeros when empty), for benchmark reports.
func Percentiles(ds []time.Duration) [3]time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return [3]time.Duration{}
	}
	at := func(p float64) time.Duration { return s[int(p*float64(len(s)-1))] }
	return [3]time.Duration{at(0.50), at(0.99), s[len(s)-1]}
}

// EnvInt reads a benchmark knob: the environment variable name when it holds a positive integer,
// otherwise def.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
