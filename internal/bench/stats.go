package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Latencies collects durations from many goroutines.
type Latencies struct {
	mu sync.Mutex
	d  []time.Duration
}

// Add records one latency.
func (l *Latencies) Add(d time.Duration) { l.mu.Lock(); l.d = append(l.d, d); l.mu.Unlock() }

// Summary is what a table row and the JSON carry about latencies (milliseconds).
type Summary struct {
	N     int     `json:"n"`
	P50ms float64 `json:"p50_ms"`
	P90ms float64 `json:"p90_ms"`
	P99ms float64 `json:"p99_ms"`
	MaxMs float64 `json:"max_ms"`
}

// Summary computes percentiles (nearest rank).
func (l *Latencies) Summary() Summary {
	l.mu.Lock()
	d := append([]time.Duration(nil), l.d...)
	l.mu.Unlock()
	if len(d) == 0 {
		return Summary{}
	}
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	q := func(p float64) float64 {
		i := int(p*float64(len(d))+0.999999) - 1
		if i < 0 {
			i = 0
		}
		if i >= len(d) {
			i = len(d) - 1
		}
		return ms(d[i])
	}
	return Summary{N: len(d), P50ms: q(0.50), P90ms: q(0.90), P99ms: q(0.99), MaxMs: ms(d[len(d)-1])}
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// Errors counts failures by OK prefix ("duplicate", "invalid", ..., "timeout", "closed").
type Errors struct {
	mu sync.Mutex
	m  map[string]int
}

// Add counts one failure under the prefix of msg (the text before the first colon).
func (e *Errors) Add(msg string) {
	p := msg
	if i := strings.IndexByte(msg, ':'); i > 0 {
		p = msg[:i]
	}
	if p == "" {
		p = "error"
	}
	e.mu.Lock()
	if e.m == nil {
		e.m = map[string]int{}
	}
	e.m[p]++
	e.mu.Unlock()
}

// Map returns a copy.
func (e *Errors) Map() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[string]int{}
	for k, v := range e.m {
		out[k] = v
	}
	return out
}

// Row is one line of a scenario's table.
type Row struct {
	Name     string         `json:"name"`
	Conns    int            `json:"conns"`
	Count    int            `json:"count"`
	Seconds  float64        `json:"seconds"`
	Rate     float64        `json:"rate_per_s"`
	Target   float64        `json:"target_rate_per_s,omitempty"`
	Latency  Summary        `json:"latency"`
	Errors   map[string]int `json:"errors,omitempty"`
	Note     string         `json:"note,omitempty"`
	Baseline bool           `json:"baseline,omitempty"`
}

// Result is one scenario run: its rows (baseline rows marked) and the headline ratio.
type Result struct {
	Scenario string    `json:"scenario"`
	Started  time.Time `json:"started"`
	Relays   []string  `json:"relays"`
	Rows     []Row     `json:"rows"`
	// Ratio is the relay figure over its baseline (RatioWhat says which figures).
	Ratio     float64           `json:"ratio,omitempty"`
	RatioWhat string            `json:"ratio_what,omitempty"`
	Extra     map[string]any    `json:"extra,omitempty"`
	Notes     []string          `json:"notes,omitempty"`
	Env       map[string]string `json:"env,omitempty"`
}

// Print writes the result as a table.
func (r *Result) Print(w io.Writer) {
	fmt.Fprintf(w, "\n== %s (%s)\n", r.Scenario, r.Started.Format(time.RFC3339))
	fmt.Fprintf(w, "%-34s %5s %7s %7s %9s %8s %8s %8s %8s  %s\n",
		"row", "conns", "count", "secs", "rate/s", "p50ms", "p99ms", "maxms", "target", "errors")
	for _, row := range r.Rows {
		name := row.Name
		if row.Baseline {
			name = "[sql] " + name
		}
		tgt := "-"
		if row.Target > 0 {
			tgt = fmt.Sprintf("%.0f", row.Target)
		}
		fmt.Fprintf(w, "%-34s %5d %7d %7.2f %9.1f %8.2f %8.2f %8.2f %8s  %s\n", trunc(name, 34), row.Conns, row.Count,
			row.Seconds, row.Rate, row.Latency.P50ms, row.Latency.P99ms, row.Latency.MaxMs, tgt, fmtErrors(row.Errors))
		if row.Note != "" {
			fmt.Fprintf(w, "%-34s   %s\n", "", row.Note)
		}
	}
	if r.RatioWhat != "" {
		fmt.Fprintf(w, "ratio %.3f  (%s)\n", r.Ratio, r.RatioWhat)
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

func trunc(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

func fmtErrors(m map[string]int) string {
	if len(m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// WriteJSON writes results to path (an array).
func WriteJSON(path string, results []*Result) error {
	b, err := json.MarshalIndent(results, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// tally collects what timed jobs did, from any number of workers, into a Row.
type tally struct {
	lats Latencies
	errs Errors
	done atomic.Int64 // jobs that ran, with or without an error message
}

// add records one job that ran: its latency, and its error message unless "".
func (t *tally) add(lat time.Duration, msg string) {
	t.done.Add(1)
	if msg != "" {
		t.errs.Add(msg)
	}
	t.lats.Add(lat)
}

// row is what the jobs did since start, against the target rate (0: none).
func (t *tally) row(start time.Time, target float64) Row {
	el := time.Since(start)
	n := int(t.done.Load())
	return Row{Count: n, Seconds: el.Seconds(), Rate: float64(n) / el.Seconds(), Target: target,
		Latency: t.lats.Summary(), Errors: t.errs.Map()}
}
