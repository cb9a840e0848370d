package upkeep

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// RunOnce makes one pass if this process can take the upkeep lock, and reports whether it did.
// Without the lock it purges nothing: another process is the one doing upkeep.
func (u *Upkeep) RunOnce(ctx context.Context) (leader bool, err error) {
	defer func() {
		if err != nil {
			if ctx.Err() == nil {
				metrics.UpkeepErrors.Inc()
			}
			u.Close() // a session in an unknown state gives the lock up; the next pass reconnects
		}
	}()
	conn, err := u.connect(ctx)
	if err != nil {
		return false, err
	}
	if err := conn.QueryRow(ctx, `SELECT buzz.upkeep_try_lock()`).Scan(&leader); err != nil {
		return false, fmt.Errorf("take the upkeep lock: %w", err)
	}
	if !leader {
		return false, nil
	}
	hooks.At(ctx, HookLeader)
	if err := u.writeSettings(ctx, conn); err != nil {
		return true, err
	}
	rules, err := ruleNames(ctx, conn)
	if err != nil {
		return true, err
	}
	for _, rule := range rules {
		if err := u.purgeRule(ctx, conn, rule); err != nil {
			return true, err
		}
	}
	metrics.UpkeepRuns.Inc()
	metrics.UpkeepLastRun.Set(float64(time.Now().Unix()))
	return true, nil
}

func (u *Upkeep) connect(ctx context.Context) (*pgx.Conn, error) {
	if u.conn != nil && !u.conn.IsClosed() {
		return u.conn, nil
	}
	cfg, err := pgx.ParseConfig(u.cfg.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["application_name"] = "buzzpg-upkeep:" + u.cfg.InstanceID
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("upkeep connection: %w", err)
	}
	u.conn = conn
	return conn, nil
}

// writeSettings publishes the lock holder's grace and reminder keep in buzz.config, where the
// purge and buzz.upkeep_status() read them.
func (u *Upkeep) writeSettings(ctx context.Context, conn *pgx.Conn) error {
	_, err := conn.Exec(ctx, `INSERT INTO buzz.config AS c (key, value)
		VALUES ('upkeep_grace_seconds', $1::text), ('upkeep_reminder_keep_seconds', $2::text)
		ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value WHERE c.value IS DISTINCT FROM EXCLUDED.value`,
		strconv.FormatInt(int64(u.cfg.Grace/time.Second), 10), strconv.FormatInt(int64(u.cfg.ReminderKeep/time.Second), 10))
	if err != nil {
		return fmt.Errorf("write upkeep settings: %w", err)
	}
	return nil
}

// ruleNames lists the built-in rules, then the enabled retention rules by name.
func ruleNames(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `SELECT 'retention:' || name FROM buzz.retention WHERE enabled ORDER BY name`)
	if err != nil {
		return nil, fmt.Errorf("read retention rules: %w", err)
	}
	more, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read retention rules: %w", err)
	}
	return append([]string{"expired", "reminders"}, more...), nil
}

// purgeRule removes a rule's rows batch by batch, each batch its own transaction, until a batch
// comes back short (nothing left, or only rows busy right now, which the next pass takes).
func (u *Upkeep) purgeRule(ctx context.Context, conn *pgx.Conn, rule string) error {
	var total int64
	for ctx.Err() == nil {
		var n int
		if err := conn.QueryRow(ctx, `SELECT buzz.upkeep_purge($1::text, $2::integer)`, rule, u.cfg.Batch).Scan(&n); err != nil {
			return fmt.Errorf("purge %s: %w", rule, err)
		}
		total += int64(n)
		metrics.UpkeepRowsPurged.WithLabelValues(rule).Add(float64(n))
		if n < u.cfg.Batch {
			break
		}
		u.pause(ctx)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if _, err := conn.Exec(ctx, `SELECT buzz.upkeep_finish($1::text, $2::bigint)`, rule, total); err != nil {
		return fmt.Errorf("finish %s: %w", rule, err)
	}
	if total > 0 {
		u.log.Info("upkeep purged", "rule", rule, "rows", total)
	}
	return nil
}

// pause waits Pause between two batches (or until ctx ends), so a long purge takes turns with the
// relay's traffic instead of competing for PostgreSQL's CPU all along.
func (u *Upkeep) pause(ctx context.Context) {
	if u.cfg.Pause <= 0 {
		return
	}
	fired, stop := u.newTimer(u.cfg.Pause)
	defer stop()
	select {
	case <-ctx.Done():
	case <-fired:
	}
}
