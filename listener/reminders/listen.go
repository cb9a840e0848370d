package reminders

import (
	"context"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// listenLoop holds a dedicated connection that LISTENs on buzz_reminders (accept_event notifies
// with the new reminder's not_before; rollbacks notify too). A reminder due before the time the
// scheduler sleeps until wakes it. On every (re)connect it nudges once, since notifications sent
// while it was away are lost; MaxSleep bounds the delay of anything else missed.
func (s *Scheduler) listenLoop(ctx context.Context) {
	const firstWait = 100 * time.Millisecond
	wait := firstWait
	for ctx.Err() == nil {
		listenedAt, err := s.listenOnce(ctx)
		s.listening.Store(false)
		if ctx.Err() != nil {
			return
		}
		if !listenedAt.IsZero() && time.Since(listenedAt) >= s.listenStable {
			// A connection that listened for a while was healthy: back off from the start again,
			// or after a few blips over a long life every reconnect would wait the full 5 s, and
			// notifications sent meanwhile are lost. One cut right after LISTEN (a proxy, an
			// idle_session_timeout) keeps backing off instead of reconnecting 10 times a second.
			wait = firstWait
		}
		s.log.Warn("reminder LISTEN connection lost; reconnecting", "err", err, "in", wait)
		if s.onListenWait != nil {
			s.onListenWait(wait)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		wait = min(wait*2, 5*time.Second)
	}
}

// listenOnce LISTENs until the connection fails; listenedAt is when LISTEN succeeded (zero if it
// never did).
func (s *Scheduler) listenOnce(ctx context.Context) (listenedAt time.Time, err error) {
	var cfg *pgx.ConnConfig
	if s.cfg.DatabaseURL != "" {
		c, err := pgx.ParseConfig(s.cfg.DatabaseURL)
		if err != nil {
			return time.Time{}, err
		}
		cfg = c
	} else {
		cfg = s.pool.Config().ConnConfig.Copy()
	}
	cfg.RuntimeParams["application_name"] = "buzzpg-reminders:" + s.cfg.InstanceID
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return time.Time{}, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `LISTEN buzz_reminders`); err != nil {
		return time.Time{}, err
	}
	listenedAt = time.Now()
	s.listening.Store(true)
	s.nudge()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return listenedAt, err
		}
		nb, perr := strconv.ParseInt(n.Payload, 10, 64)
		planned := s.plannedWake.Load()
		// planned == 0: the loop is between sleeps; its next-wake query may already have run
		// without this row, so nudge (the buffered channel coalesces a flood into one re-check).
		if perr != nil || planned == 0 || time.Unix(nb, 0).UnixNano() < planned {
			s.nudge()
		}
	}
}
