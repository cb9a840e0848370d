// Package reminders is the NIP-ER reminder scheduler: it sleeps until the earliest due not_before (or the
// earliest claim lease expiry), claims due reminder versions in batches with a stamp and a lease,
// and confirms them; confirming emits the due signal as a transactional logical message that the
// fan-out tail of every process delivers (sql/0004_reminders.up.sql). The database fences every
// step by the stamp, so this side needs no locks across processes:
//   - of concurrent claims exactly one wins (SKIP LOCKED batches take disjoint sets);
//   - confirm emits only while the row is still claimed under our stamp, so at most one
//     confirm per version commits, and the signal is emitted once (I6);
//   - a failed confirm is rolled back under our stamp; a claim whose owner died is re-taken
//     after its lease by any scheduler with a new stamp, so none is orphaned.
package reminders

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

// Config configures one process's reminder scheduler.
type Config struct {
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
	cfg  Config
	pool *pgxpool.Pool
	log  *slog.Logger

	wake chan struct{} // buffered(1): coalesced nudges from NOTIFY and rollbacks
	// plannedWake is the database-clock time (unix nanos) the loop sleeps until; the LISTEN
	// goroutine nudges only for reminders due before it, so a flood of stored reminders does not
	// turn into a flood of wake-ups.
	plannedWake atomic.Int64

	mu       sync.Mutex
	inflight map[string]int64 // id -> stamp of our claims not yet confirmed or rolled back
	runner   listener.Runner

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
func NewScheduler(cfg Config, pool *pgxpool.Pool) *Scheduler {
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
	ctx, finish, ok := s.runner.Start(ctx)
	if !ok {
		return errors.New("reminder scheduler: already running or closed")
	}
	defer finish()

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
	if err := s.runner.Stop(ctx); err != nil {
		return err
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
