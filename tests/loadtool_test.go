package tests

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// TestLoadToolRunsItsScenarios runs the load tool behind the README's figures (`buzzpg bench`)
// for a second per scenario against two relays it starts itself, so that the tool cannot rot
// unnoticed between the sessions that measure with it. It checks what the tool did, not how fast:
// every scenario reported rows, no row counted errors, and fan-out with quiet connections open
// (--idle) delivered every event it sent. Flood is left out: its twelve phases take a minute.
func TestLoadToolRunsItsScenarios(t *testing.T) {
	out := filepath.Join(t.TempDir(), "results.json")
	const rate, idle = 200, 20
	cmd := exec.Command(testenv.Binary(t), "bench", "ingest,dm,converge,reminders,fanout",
		"--spawn", "2", "--database-url", testenv.DB(t), "--duration", "1s", "--conns", "2",
		"--rate", strconv.Itoa(rate), "--n", "1000", "--idle", strconv.Itoa(idle), "--json", out)
	log, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("buzzpg bench: %v\n%s", err, log)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	var results []bench.Result
	if err := json.Unmarshal(b, &results); err != nil {
		t.Fatalf("results: %v\n%s", err, b)
	}
	var got []string
	for _, r := range results {
		got = append(got, r.Scenario)
		if len(r.Rows) == 0 {
			t.Errorf("%s: no rows", r.Scenario)
		}
		for _, row := range r.Rows {
			if row.Count == 0 || len(row.Errors) > 0 {
				t.Errorf("%s / %s: count %d, errors %v", r.Scenario, row.Name, row.Count, row.Errors)
			}
		}
		if r.Scenario != "fanout" {
			continue
		}
		if r.Extra["idle_connections"] != float64(idle) {
			t.Errorf("fanout: idle connections %v, want %d", r.Extra["idle_connections"], idle)
		}
		// The relay row counts what the subscriber on B received: 1 s at 200/s is 200 events.
		if i := slices.IndexFunc(r.Rows, func(row bench.Row) bool { return !row.Baseline }); i < 0 || r.Rows[i].Count != rate {
			t.Errorf("fanout: rows %+v, want %d delivered on the relay row", r.Rows, rate)
		}
	}
	want := []string{"ingest", "dm-hot", "dm-mix", "dm-resurface", "converge", "reminders", "fanout"}
	if !slices.Equal(got, want) {
		t.Errorf("scenarios %v, want %v\n%s", got, want, log)
	}
}
