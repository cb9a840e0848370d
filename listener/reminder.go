// This file is the NIP-ER reminder scheduler: it sleeps until the earliest due not_before (or the
// earliest claim lease expiry), claims due reminder versions in batches with a stamp and a lease,
// and confirms them; confirming emits the due signal as a transactional logical message that the
// fan-out tail of every process delivers (sql/0004_reminders.up.sql). The database fences every
// step by the stamp, so this side needs no locks across processes:
//   - of concurrent claims exactly one wins (SKIP LOCKED batches take disjoint sets);
//   - confirm emits only while the row is still claimed under our stamp, so at most one
//     confirm per version commits, and the signal is emitted once (I6);
//   - a failed confirm is rolled back under our stamp; a claim whose owner died is re-taken
//     after its lease by any scheduler with a new stamp, so none is orphaned.
package listener

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// SchedulerConfig configures one process's reminder scheduler.
type SchedulerConfig struct {
	InstanceID  string
	Lease       time.Duration // claim lease; a claim unresolved this long is recovered by anyone. Default 30s.
	MinInterval time.Duration // floor on any wait (no busy loop); default 10ms
	MaxSleep    time.Duration // re-check at least this often (lost NOTIFY, lease recovery); default 5s
	BatchSize   int           // claims per transaction; default 500
	Logger      *slog.Logger
	DatabaseURL string // for the dedicated LISTEN buzz_reminders connection; default: the pool's config
}

// Scheduler claims due reminders and confirms them (emitting the due signal).
type Scheduler struct {
	cfg  SchedulerConfig
	pool *pgxpool.Pool
	log  *slog.Logger

	wake chan struct{} // buffered(1): coalesced nudges from NOTIFY and rollbacks
	// plannedWake is the database-clock time (unix nanos) the loop sleeps until; the LISTEN
	// goroutine nudges only for reminders due before it, so a flood of stored reminders does not
	// turn into a flood of wake-ups.
	plannedWake atomic.Int64

	mu       sync.Mutex
	inflight map[string]int64 // id -> stamp of our claims not yet confirmed or rolled back
	cancel   context.CancelFunc
	done     chan struct{}
	closed   bool

	// listenStable is how long a LISTEN connection must have lasted for its loss to restart the
	// reconnect back-off (a variable for tests).
	listenStable time.Duration

	// For tests: each wait the loop is about to sleep (after the wake-up query), and each wait
	// before a LISTEN reconnect.
	onWait, onListenWait func(time.Duration)

	// Counters for tests.
	confirmed atomic.Int64
	lost      atomic.Int64
	rolled    atomic.Int64
	listening atomic.Bool
}

// NewScheduler applies defaults; Run starts it.
func NewScheduler(cfg SchedulerConfig, pool *pgxpool.Pool) *Scheduler {
	if cfg.Lease <= 0 {
		cfg.Lease = 30 * time.Second
	}
	if cfg.MinInterval <= 0 {
		cfg.MinInterval = 10 * time.Millisecond
	}
	if cfg.MaxSleep <= 0 {
		cfg.MaxSleep = 5 * time.Second
	}
	if cfg.MaxSleep < cfg.MinInterval {
		cfg.MaxSleep = cfg.MinInterval
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 500
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Scheduler{
		cfg:      cfg,
		pool:     pool,
		log:      cfg.Logger.With("component", "reminders"),
		wake:     make(chan struct{}, 1),
		inflight: map[string]int64{},

		listenStable: 5 * time.Second,
	}
}

// Run schedules until ctx ends or Close is called. On the way out it rolls back the claims it
// still holds unconfirmed, so another process can deliver them at once instead of after the lease.
func (s *Scheduler) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.closed || s.done != nil {
		s.mu.Unlock()
		return errors.New("reminder scheduler: already running or closed")
	}
	ctx, cancel := context.WithCancel(ctx)
	s.cancel, s.done = cancel, make(chan struct{})
	s.mu.Unlock()
	defer close(s.done)
	defer cancel()

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); s.listenLoop(ctx) }()
	defer wg.Wait()

	s.log.Info("reminder scheduler started", "lease", s.cfg.Lease, "batch", s.cfg.BatchSize,
		"min_interval", s.cfg.MinInterval, "max_sleep", s.cfg.MaxSleep)
	errWait := s.cfg.MinInterval
	overdue := 0 // passes in a row that claimed nothing although work was due
	for ctx.Err() == nil {
		n, err := s.runBatch(ctx)
		if err != nil && ctx.Err() == nil {
			// Database trouble: back off (doubling from the floor up to MaxSleep) instead of spinning.
			if !errors.As(err, new(errConfirm)) {
				metrics.ReminderClaims.WithLabelValues("failed").Inc()
			}
			s.log.Warn("reminder batch failed", "err", err, "retry_in", errWait)
			s.sleep(ctx, errWait, false)
			errWait = min(errWait*2, s.cfg.MaxSleep)
			continue
		}
		errWait = s.cfg.MinInterval
		if n >= s.cfg.BatchSize {
			continue // a burst: take the next batch right away
		}
		// A due row the claim skipped (SKIP LOCKED: another transaction holds it) keeps the next
		// wake-up in the past. Re-polling it every MinInterval would run claim and wake-up query
		// 100 times a second for as long as that transaction lasts, on every process; double the
		// wait instead, up to overduePollMax (how late such a row can then be once it is free).
		floor := s.cfg.MinInterval
		if n == 0 && overdue > 0 {
			floor = min(s.cfg.MinInterval<<min(overdue, 16), max(overduePollMax, s.cfg.MinInterval), s.cfg.MaxSleep)
		}
		wait, due, err := s.nextWait(ctx, floor)
		if err != nil && ctx.Err() == nil {
			s.log.Warn("reminder next wake-up query failed", "err", err)
			wait = s.cfg.MinInterval
		}
		if n == 0 && due && err == nil && !s.expiredDue(ctx) {
			overdue++
		} else {
			overdue = 0
		}
		if s.onWait != nil {
			s.onWait(wait)
		}
		s.sleep(ctx, wait, true)
	}
	s.releaseAll(context.WithoutCancel(ctx), 10*time.Second)
	return nil
}

// Close stops Run and rolls back this scheduler's unconfirmed claims (stamp-guarded, so a claim
// someone else recovered meanwhile is left alone).
func (s *Scheduler) Close(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	cancel, done := s.cancel, s.done
	s.mu.Unlock()
	if cancel != nil {
		cancel()
		select {
		case <-done:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return s.releaseAll(ctx, 0)
}

// overduePollMax caps the wait between re-checks of due work that claims keep skipping.
const overduePollMax = time.Second

// expiredDue reports whether due armed rows whose NIP-40 expiration has passed remain: a claim
// cancels those instead of returning them, so an empty claim was progress through such a backlog
// (after an outage, say), not a skipped row, and the loop must not back off behind it. An error
// reads as no (the back-off then only delays by up to overduePollMax).
func (s *Scheduler) expiredDue(ctx context.Context) bool {
	var found bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM buzz.reminders
		WHERE state = 'armed' AND not_before <= extract(epoch FROM now()) AND expires_at <= extract(epoch FROM now()))`).Scan(&found)
	return err == nil && found
}

// nextWait asks the database how long to sleep: until the earliest armed not_before or the
// earliest lease expiry, capped by MaxSleep and floored by floor (at least MinInterval). due
// reports that such work is already due (the wait was cut to the floor). Durations are computed
// against the database clock, which is the one claims compare with.
func (s *Scheduler) nextWait(ctx context.Context, floor time.Duration) (wait time.Duration, due bool, err error) {
	var nb *int64
	var lease *time.Time
	var dbNow time.Time
	err = s.pool.QueryRow(ctx, `SELECT next_not_before, next_lease_expiry, db_now FROM buzz.next_reminder_wakeup()`).
		Scan(&nb, &lease, &dbNow)
	if err != nil {
		return s.cfg.MinInterval, false, err
	}
	wait = s.cfg.MaxSleep
	if nb != nil {
		wait = min(wait, time.Unix(*nb, 0).Sub(dbNow))
	}
	if lease != nil {
		// A lease expiring is work too (recovery); a hair after it, as claims test lease_until < now().
		wait = min(wait, lease.Sub(dbNow)+time.Millisecond)
	}
	due = wait <= s.cfg.MinInterval
	wait = max(wait, floor, s.cfg.MinInterval)
	s.plannedWake.Store(dbNow.Add(wait).UnixNano())
	s.log.Debug("reminder scheduler sleeping", "for", wait, "next_not_before", nb, "db_now", dbNow)
	return wait, due, nil
}

// sleep waits for d, ctx, or (when wakeable) a nudge.
func (s *Scheduler) sleep(ctx context.Context, d time.Duration, wakeable bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	var wake <-chan struct{}
	if wakeable {
		wake = s.wake
	}
	select {
	case <-ctx.Done():
	case <-t.C:
	case <-wake:
	}
	s.plannedWake.Store(0)
}

func (s *Scheduler) nudge() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

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
	cctx, cancel := claimContext(ctx)
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
	ctx, cancel := claimContext(ctx)
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
	case isServerError(err):
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

// isServerError reports whether PostgreSQL answered with an ERROR: the statement (and its implicit
// transaction) was then rolled back for certain. A FATAL (e.g. pg_terminate_backend) may arrive
// after the commit already happened, so it counts as an unknown outcome. Severity is translated
// by lc_messages ("FEHLER"); the unlocalized field is not.
func isServerError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	sev := pgErr.SeverityUnlocalized
	if sev == "" { // servers before 9.6
		sev = pgErr.Severity
	}
	return sev == "ERROR"
}

// firstFew names a handful of ids for a log line about many.
func firstFew(ids []string) []string {
	return ids[:min(len(ids), 5)]
}
