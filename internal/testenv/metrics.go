package testenv

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// CounterTotal sums the in-process counter name over all its label values (0 when it has none
// yet), so a test can assert that nothing of a kind happened whatever its label would have been.
func CounterTotal(tb testing.TB, name string) float64 {
	tb.Helper()
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}
