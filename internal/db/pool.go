// Package db holds the thin pgx plumbing every side shares: pools with an application_name per
// role (so tests and operators can find and pg_terminate_backend the right backend), retries of
// serialization failures and deadlocks, and the one migrator construction.
package db

import (
	"context"
	"errors"
	"fmt"
	"time"

	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PoolOption adjusts a pool's configuration before it opens (see store.WarmAccept).
type PoolOption func(*pgxpool.Config)

// NewPool opens a pool whose connections carry appName (e.g. "buzzpg-accept:<instance>").
func NewPool(ctx context.Context, url, appName string, maxConns int32, opts ...PoolOption) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("invalid DATABASE_URL: %w", err)
	}
	if appName != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	cfg.MaxConnIdleTime = 5 * time.Minute
	cfg.HealthCheckPeriod = 15 * time.Second
	for _, o := range opts {
		o(cfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pingCtx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("cannot reach PostgreSQL at %s: %w (is it running? `make run` starts a private cluster; DATABASE_URL overrides)", redact(cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database), err)
	}
	return pool, nil
}

func redact(host string, port uint16, database string) string {
	return fmt.Sprintf("%s:%d/%s", host, port, database)
}

// Retryable reports whether err is a deadlock (40P01) or serialization failure (40001): the
// transaction was rolled back as a whole and may simply run again. Every buzz function is
// idempotent by event id, so a retry after such an error is safe.
func Retryable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code == "40P01" || pgErr.Code == "40001"
	}
	return false
}

// Retry runs fn until it succeeds, fails with a non-retryable error, ctx ends, or 8 attempts.
func Retry(ctx context.Context, fn func(ctx context.Context) error) error {
	backoff := 2 * time.Millisecond
	var err error
	for attempt := 0; attempt < 8; attempt++ {
		err = fn(ctx)
		if err == nil || !Retryable(err) {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		backoff *= 2
	}
	return err
}

// SQLState returns the SQLSTATE of err, or "".
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// WaitReachable waits up to wait for PostgreSQL to accept connections (a process started while
// the server restarts should not die for it). It returns the last error, explained, after that.
func WaitReachable(ctx context.Context, url string, wait time.Duration, log *slog.Logger) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return fmt.Errorf("invalid DATABASE_URL: %w", err)
	}
	deadline := time.Now().Add(wait)
	backoff := 100 * time.Millisecond
	for attempt := 0; ; attempt++ {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		conn, err := pgx.ConnectConfig(cctx, cfg)
		cancel()
		if err == nil {
			conn.Close(ctx)
			return nil
		}
		if time.Now().Add(backoff).After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("cannot reach PostgreSQL at %s: %w (is it running? `make run` starts a private cluster; DATABASE_URL overrides)", redact(cfg.Host, cfg.Port, cfg.Database), err)
		}
		if attempt == 0 && log != nil {
			log.Warn("waiting for PostgreSQL", "err", err, "for", wait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(backoff):
		}
		if backoff < 2*time.Second {
			backoff *= 2
		}
	}
}
