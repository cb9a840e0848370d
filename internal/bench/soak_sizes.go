package bench

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"
)

// soakTables are the hot tables whose sizes the soak follows.
var soakTables = []string{"visibility_state", "visibility_outbox", "reminders", "instances"}

// soakSample is one minute's sizes (bytes) and the expired events still stored.
type soakSample struct {
	at      time.Duration
	total   map[string]int64 // pg_total_relation_size per table
	heap    map[string]int64 // pg_relation_size per table
	upd     map[string]int64 // n_tup_upd and n_tup_hot_upd per table (pg_stat_user_tables)
	hot     map[string]int64
	indexes map[string][]string
	wal     int64 // the most WAL one slot of this database retains
	expired int64 // events past expiration by more than grace + one purge interval
	events  int64
	sent    int64 // events the traffic had published by then
	err     error
}

func (s *soak) sample(at time.Duration) soakSample {
	sm := soakSample{at: at, total: map[string]int64{}, heap: map[string]int64{}, indexes: map[string][]string{},
		upd: map[string]int64{}, hot: map[string]int64{}}
	sm.sent = s.sent.done.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, t := range soakTables {
		rel := "buzz." + t
		var total, heap, upd, hot int64
		if err := s.pool.QueryRow(ctx, `SELECT pg_total_relation_size($1::regclass), pg_relation_size($1::regclass),
			  coalesce(n_tup_upd, 0), coalesce(n_tup_hot_upd, 0) FROM pg_stat_user_tables WHERE relid = $1::regclass`, rel).
			Scan(&total, &heap, &upd, &hot); err != nil {
			sm.err = err
			return sm
		}
		sm.total[t], sm.heap[t], sm.upd[t], sm.hot[t] = total, heap, upd, hot
		rows, err := s.pool.Query(ctx, `SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
			WHERE i.indrelid = $1::regclass ORDER BY c.relname`, rel)
		if err != nil {
			sm.err = err
			return sm
		}
		for rows.Next() {
			var name string
			var size int64
			_ = rows.Scan(&name, &size)
			sm.indexes[t] = append(sm.indexes[t], fmt.Sprintf("%s=%dk", name, size>>10))
		}
		rows.Close()
	}
	slack := int64(upkeepInterval() / time.Second)
	sm.err = s.pool.QueryRow(ctx, `SELECT
		  coalesce((SELECT max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn))::bigint FROM pg_replication_slots
		             WHERE database = current_database()), 0),
		  (SELECT count(*) FROM buzz.events WHERE expires_at < extract(epoch FROM now())::bigint
		      - (SELECT value::bigint FROM buzz.config WHERE key = 'upkeep_grace_seconds') - $1::bigint),
		  (SELECT count(*) FROM buzz.events)`, slack).Scan(&sm.wal, &sm.expired, &sm.events)
	return sm
}

func (s *soak) printHeader() {
	fmt.Fprintf(os.Stdout, "\n%5s %-18s %9s %9s %9s %5s  %-s\n", "min", "table", "total_kB", "heap_kB", "updates", "hot%", "indexes (kB)")
}

func (s *soak) printSample(sm soakSample) {
	if sm.err != nil {
		fmt.Fprintf(os.Stdout, "%5.1f sample failed: %v\n", sm.at.Minutes(), sm.err)
		return
	}
	for _, t := range soakTables {
		fmt.Fprintf(os.Stdout, "%5.1f %-18s %9d %9d %9d %5.1f  %s\n", sm.at.Minutes(), t, sm.total[t]>>10, sm.heap[t]>>10,
			sm.upd[t], 100*ratio(float64(sm.hot[t]), float64(sm.upd[t])), strings.Join(sm.indexes[t], " "))
	}
	var before int64
	if n := len(s.samples); n >= 2 {
		before = s.samples[n-2].sent
	}
	fmt.Fprintf(os.Stdout, "%5.1f slot WAL retained %d kB; events %d, expired past grace+interval %d; sent %d since the last sample\n",
		sm.at.Minutes(), sm.wal>>10, sm.events, sm.expired, sm.sent-before)
}

// warmup is a third of the run, at most five minutes (the bar is minute 5 to minute 20).
func (s *soak) warmup() time.Duration {
	return min(5*time.Minute, s.cfg.Duration/3)
}

// check applies the bar to the samples and notes the figures.
func (s *soak) check() error {
	var fails []string
	first, last := s.atWarmup(), s.samples[len(s.samples)-1]
	if first.err != nil || last.err != nil {
		return fmt.Errorf("soak: a sample failed: %v %v", first.err, last.err)
	}
	var a, b int64
	for _, t := range soakTables {
		a, b = a+first.total[t], b+last.total[t]
		g := growth(first.total[t], last.total[t])
		s.res.Extra["growth_"+t] = g
		lo, hi, slope := s.trend(t)
		s.res.Extra["slope_kB_per_min_"+t] = slope
		s.res.Notes = append(s.res.Notes, fmt.Sprintf("%s: %d kB at %.0f min -> %d kB at %.0f min (%+.1f%%); after the warm-up %d-%d kB, slope %+.1f kB/min",
			t, first.total[t]>>10, first.at.Minutes(), last.total[t]>>10, last.at.Minutes(), 100*g, lo>>10, hi>>10, slope))
		// A table of a few pages gains its free space map and visibility map (32 kB) at its first
		// vacuum: allow 64 kB besides the 10%.
		if last.total[t]-first.total[t] > first.total[t]/10+64<<10 {
			fails = append(fails, fmt.Sprintf("%s grew %+.1f%% after the warm-up", t, 100*g))
		}
	}
	s.res.Extra["growth_hot_tables"] = growth(a, b)
	s.res.Notes = append(s.res.Notes, fmt.Sprintf("hot tables together: %d kB -> %d kB (%+.1f%%)", a>>10, b>>10, 100*growth(a, b)))
	var walMax int64
	for _, sm := range s.samples {
		walMax = max(walMax, sm.wal)
	}
	s.res.Extra["wal_retained_max"] = walMax
	s.res.Notes = append(s.res.Notes, fmt.Sprintf("slot WAL retained: at most %d kB (bound %d kB)", walMax>>10, soakWALBound>>10))
	if walMax > soakWALBound {
		fails = append(fails, fmt.Sprintf("a slot retained %d kB of WAL", walMax>>10))
	}
	s.res.Notes = append(s.res.Notes, fmt.Sprintf("expired events older than grace + one purge interval (%s) at the end: %d", upkeepInterval(), last.expired))
	if last.expired > 0 {
		fails = append(fails, fmt.Sprintf("%d expired events older than the grace period are still stored", last.expired))
	}
	if len(fails) > 0 {
		return fmt.Errorf("soak bar not met: %s", strings.Join(fails, "; "))
	}
	s.res.Notes = append(s.res.Notes, "soak bar met")
	return nil
}

// trend is a table's smallest and largest size from the warm-up on, and the least-squares slope
// of its size over those samples in kB per minute: a table whose size saws up and down with its
// vacuums shows a wide range and a flat slope, a table that grows a steady slope.
func (s *soak) trend(t string) (lo, hi int64, slope float64) {
	var n, sx, sy, sxx, sxy float64
	lo = -1
	for _, sm := range s.samples {
		if sm.at < s.warmup()-time.Second || sm.err != nil {
			continue
		}
		x, y := sm.at.Minutes(), float64(sm.total[t])/1024
		n, sx, sy, sxx, sxy = n+1, sx+x, sy+y, sxx+x*x, sxy+x*y
		if lo < 0 || sm.total[t] < lo {
			lo = sm.total[t]
		}
		hi = max(hi, sm.total[t])
	}
	if d := n*sxx - sx*sx; n >= 2 && d > 0 {
		slope = (n*sxy - sx*sy) / d
	}
	return max(lo, 0), hi, slope
}

// atWarmup is the first sample taken at or after the warm-up.
func (s *soak) atWarmup() soakSample {
	for _, sm := range s.samples {
		if sm.at >= s.warmup()-time.Second {
			return sm
		}
	}
	return s.samples[len(s.samples)-1]
}

func growth(a, b int64) float64 {
	if a == 0 {
		return 0
	}
	return float64(b-a) / float64(a)
}
