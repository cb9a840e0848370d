package reminders

import (
	"context"
	"time"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

// confirmBatch emits and confirms the batch in one autocommit statement. Its outcomes:
//   - committed: the returned ids are confirmed (emitted); the rest were no longer ours (lost);
//   - the server reported an error: nothing committed, so roll our claims back with the stamps;
//   - anything else (connection lost mid-statement, at COMMIT): the outcome is unknown, so re-read
//     the rows by stamp instead of rolling back (resolveUnknown).
func (s *Scheduler) confirmBatch(ctx context.Context, claims []claim) error {
	return s.confirmUntil(ctx, claims, time.Time{})
}

// confirmUntil is confirmBatch inside the resolution of an unknown outcome begun earlier: until
// (zero outside one) bounds every re-read and re-confirm of that resolution together.
func (s *Scheduler) confirmUntil(ctx context.Context, claims []claim, until time.Time) error {
	ids, stamps := claimArrays(claims)
	confirmed := map[string]bool{}
	err := func() error {
		rows, err := s.pool.Query(ctx, `SELECT buzz.confirm_reminder_claims($1, $2)`, ids, stamps)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				return err
			}
			confirmed[id] = true
		}
		return rows.Err()
	}()
	switch {
	case err == nil:
		s.finish(claims, confirmed)
		return nil
	case listener.IsServerError(err):
		s.log.Warn("reminder confirm failed; rolling back own claims", "n", len(claims), "err", err)
		metrics.ReminderClaims.WithLabelValues("failed").Add(float64(len(claims)))
		_, _ = s.rollback(context.WithoutCancel(ctx), claims)
		return err
	default:
		s.log.Warn("reminder confirm outcome unknown; re-reading by stamp", "n", len(claims), "err", err)
		if until.IsZero() {
			until = time.Now().Add(s.cfg.Lease)
		}
		return s.resolveUnknown(context.WithoutCancel(ctx), claims, until)
	}
}

// finish records the outcome of a committed confirm.
func (s *Scheduler) finish(claims []claim, confirmed map[string]bool) {
	now := time.Now()
	s.mu.Lock()
	for _, c := range claims {
		if s.inflight[c.id] == c.stamp {
			delete(s.inflight, c.id)
		}
	}
	s.mu.Unlock()
	var lost []string
	defer func() {
		if len(lost) > 0 {
			s.log.Info("reminder claims lost before confirm (cancelled meanwhile, or recovered by another scheduler after our lease)",
				"count", len(lost), "first", firstFew(lost))
		}
	}()
	for _, c := range claims {
		if confirmed[c.id] {
			s.confirmed.Add(1)
			metrics.ReminderClaims.WithLabelValues("confirmed").Inc()
			// No log line per signal: a burst is thousands of them; the batch line and the
			// metrics carry the figures.
			metrics.ReminderLateness.Observe(now.Sub(time.Unix(c.notBefore, 0)).Seconds())
		} else {
			// Cancelled by a newer version or deletion meanwhile, or recovered by someone else
			// after our lease expired: their stamp fenced us out, nothing was emitted by us.
			s.lost.Add(1)
			metrics.ReminderClaims.WithLabelValues("lost").Inc()
			lost = append(lost, c.id)
		}
	}
}

// resolveUnknown re-reads the rows after a confirm whose commit outcome is unknown. Rows confirmed
// under our stamp were emitted; rows still claimed under our stamp did not commit and are
// confirmed again (the fence makes that safe); anything else is no longer ours. If the database
// stays unreachable, or confirms keep ending without an answer, until the lease from the first
// unknown outcome has passed, the claims are left to lease recovery, which is stamp-fenced too.
func (s *Scheduler) resolveUnknown(ctx context.Context, claims []claim, until time.Time) error {
	ids, stamps := claimArrays(claims)
	ctx, cancel := context.WithDeadline(ctx, until)
	defer cancel()
	wait := s.cfg.MinInterval
	for {
		state := map[string]string{}
		rows, err := s.pool.Query(ctx, `SELECT r.id, r.state FROM buzz.reminders r
			JOIN unnest($1::text[], $2::bigint[]) AS u(id, stamp) ON r.id = u.id AND r.stamp = u.stamp`, ids, stamps)
		if err == nil {
			for rows.Next() {
				var id, st string
				if err = rows.Scan(&id, &st); err != nil {
					break
				}
				state[id] = st
			}
			rows.Close()
			if err == nil {
				err = rows.Err()
			}
		}
		if err == nil {
			confirmed := map[string]bool{}
			var settled, retry []claim
			for _, c := range claims {
				switch state[c.id] {
				case "confirmed": // committed under our stamp: emitted
					confirmed[c.id] = true
					settled = append(settled, c)
				case "claimed": // did not commit, still ours
					retry = append(retry, c)
				default: // no longer ours (recovered, cancelled): nothing of ours was emitted
					settled = append(settled, c)
				}
			}
			s.finish(settled, confirmed)
			if len(retry) == 0 {
				return nil
			}
			s.log.Info("reminder confirm did not commit; confirming again", "n", len(retry))
			return s.confirmUntil(ctx, retry, until)
		}
		if ctx.Err() != nil {
			s.log.Error("reminder confirm outcome still unknown; leaving claims to lease recovery",
				"n", len(claims), "err", err)
			return err
		}
		s.sleep(ctx, wait, false)
		wait = min(wait*2, time.Second)
	}
}

// rollback returns claims to armed, guarded by their stamps, and reports how many it returned.
func (s *Scheduler) rollback(ctx context.Context, claims []claim) (int, error) {
	ids, stamps := claimArrays(claims)
	rows, err := s.pool.Query(ctx, `SELECT buzz.rollback_reminder_claims($1, $2)`, ids, stamps)
	n := 0
	if err == nil {
		for rows.Next() {
			n++
		}
		rows.Close()
		err = rows.Err()
	}
	if err != nil {
		s.log.Error("reminder rollback failed; claims will be recovered after their lease", "n", len(claims), "err", err)
		return 0, err
	}
	s.mu.Lock()
	for _, c := range claims {
		if s.inflight[c.id] == c.stamp {
			delete(s.inflight, c.id)
		}
	}
	s.mu.Unlock()
	s.rolled.Add(int64(n))
	metrics.ReminderClaims.WithLabelValues("rolled_back").Add(float64(n))
	s.log.Info("reminder claims rolled back", "n", n, "stale", len(claims)-n)
	return n, nil
}

// releaseAll rolls back every claim still in flight (shutdown).
func (s *Scheduler) releaseAll(ctx context.Context, timeout time.Duration) error {
	s.mu.Lock()
	var claims []claim
	for id, st := range s.inflight {
		claims = append(claims, claim{id: id, stamp: st})
	}
	s.mu.Unlock()
	if len(claims) == 0 {
		return nil
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	_, _ = s.rollback(ctx, claims)
	return ctx.Err()
}
