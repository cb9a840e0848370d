package reminders

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

type claim struct {
	id        string
	notBefore int64
	stamp     int64
	recovered bool
}

// runBatch claims up to BatchSize due reminders and confirms them; it returns how many it claimed.
func (s *Scheduler) runBatch(ctx context.Context) (int, error) {
	t0 := time.Now()
	claims, err := s.claimBatch(ctx)
	if err != nil || len(claims) == 0 {
		return 0, err
	}
	t1 := time.Now()
	defer func() {
		s.log.Debug("reminder batch", "n", len(claims), "claim", t1.Sub(t0), "confirm", time.Since(t1))
	}()
	// Tests stop (or kill) the process here: claimed, nothing emitted yet.
	hooks.At(ctx, "reminder.after_claim")
	if ctx.Err() != nil {
		// Shutting down between claim and confirm: Run's exit releases the claims.
		return len(claims), nil
	}
	// The confirm gets the claim's grace on a stop: cut off mid-statement it would still commit
	// on the server, and our re-read (resolveUnknown) could see the row before that commit, confirm
	// again behind its lock and count an emitted signal as lost.
	cctx, cancel := listener.ClaimContext(ctx)
	defer cancel()
	if err := s.confirmBatch(cctx, claims); err != nil {
		return len(claims), errConfirm{err}
	}
	return len(claims), nil
}

// errConfirm marks a batch whose confirm failed (already counted per claim in the metrics); Run
// backs off after it like after any database error, so a persistent fault is not a hot loop of
// claim, fail, roll back.
type errConfirm struct{ error }

func (e errConfirm) Unwrap() error { return e.error }

func (s *Scheduler) claimBatch(ctx context.Context) ([]claim, error) {
	ctx, cancel := listener.ClaimContext(ctx)
	defer cancel()
	rows, err := s.pool.Query(ctx, `SELECT id, not_before, stamp, recovered FROM buzz.claim_due_reminders($1, $2, false)`,
		s.cfg.BatchSize, s.cfg.Lease)
	if err != nil {
		return nil, err
	}
	var out []claim
	for rows.Next() {
		var c claim
		if err := rows.Scan(&c.id, &c.notBefore, &c.stamp, &c.recovered); err != nil {
			rows.Close()
			s.undoClaim(ctx, out, err)
			return nil, err
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		// The claim's outcome is unknown (e.g. connection lost), but the stamps received are ours:
		// roll those back. Rows whose stamps never arrived are recovered after the lease.
		s.undoClaim(ctx, out, err)
		return nil, err
	}
	s.mu.Lock()
	for _, c := range out {
		s.inflight[c.id] = c.stamp
	}
	s.mu.Unlock()
	metrics.ReminderClaims.WithLabelValues("claimed").Add(float64(len(out)))
	var recovered []string
	for _, c := range out {
		if c.recovered {
			metrics.ReminderClaims.WithLabelValues("recovered").Inc()
			recovered = append(recovered, c.id)
		}
	}
	if len(recovered) > 0 {
		// One line per batch: recovering a dead process's burst is thousands of reminders.
		s.log.Info("reminder claims recovered after an expired lease", "count", len(recovered), "first", firstFew(recovered))
	}
	return out, nil
}

// claimArrays returns the (id, stamp) pairs sorted by id: batches then lock rows in one order.
func claimArrays(claims []claim) ([]string, []int64) {
	sorted := slices.SortedFunc(slices.Values(claims), func(a, b claim) int { return strings.Compare(a.id, b.id) })
	ids := make([]string, len(sorted))
	stamps := make([]int64, len(sorted))
	for i, c := range sorted {
		ids[i], stamps[i] = c.id, c.stamp
	}
	return ids, stamps
}

// firstFew names a handful of ids for a log line about many.
func firstFew(ids []string) []string {
	return ids[:min(len(ids), 5)]
}
