// Package db holds the thin pgx plumbing every side shares: pools with an application_name per
// role (so tests and operators can find and pg_terminate_backend the right backend), retries of
// serialization failures and deadlocks, and the one migrator construction.
package db

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PoolOption adjusts a pool's configuration before it opens (see store.WarmAccept).
type PoolOption func(*pgxpool.Config)

// SearchPath is every pool connection's search_path: buzzpg's SQL names the schema buzz, and
// nothing a role may create in another schema (public, before PostgreSQL 15) can shadow a
// function or operator it calls. It overrides one set on the role or in the URL.
const SearchPath = "pg_catalog, buzz, pg_temp"

// QuerySessions sets up the sessions that run REQs and COUNTs, which are short walks cut by their
// limit:
//   - no parallel workers: starting them costs more than they save, and a relay runs many at once;
//   - no bitmap scans: `{"kinds":[1],"limit":100}` walks events_kind_idx in the REQ's order and stops
//     at 100 rows. Before a table that grew has statistics, the planner takes kind = 1 for 0.5 % of
//     the rows and picks a bitmap scan of every match plus a sort (18.6 ms against 0.05 ms on
//     20,000 events). A walk reads no more rows than the bitmap would, whatever the statistics say.
func QuerySessions(cfg *pgxpool.Config) {
	cfg.ConnConfig.RuntimeParams["max_parallel_workers_per_gather"] = "0"
	cfg.ConnConfig.RuntimeParams["enable_bitmapscan"] = "off"
}

// NewPool opens a pool whose connections carry appName (e.g. "buzzpg-accept:<instance>") and
// SearchPath.
func NewPool(ctx context.Context, url, appName string, maxConns int32, opts ...PoolOption) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("invalid DATABASE_URL: %w", err)
	}
	if appName != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = appName
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = SearchPath
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
		c := cfg.ConnConfig
		return nil, connectError(c.Host, c.Port, c.Database, c.User, err)
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
// the server restarts should not die for it). Only what can pass is waited out: no answer at all
// (network, DNS, a server not listening yet) and the refusals of a server starting, stopping or
// full. A refusal that waiting cannot change (authentication, no such database) fails at once,
// saying what was refused. When ctx ends (the process is being stopped) it returns ctx's error.
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
		if ctx.Err() != nil {
			return ctx.Err() // stopping: not the database's fault
		}
		if !TransientConnectError(err) {
			return connectError(cfg.Host, cfg.Port, cfg.Database, cfg.User, err)
		}
		if time.Now().Add(backoff).After(deadline) {
			return connectError(cfg.Host, cfg.Port, cfg.Database, cfg.User, err)
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

// TransientConnectError reports whether a failed connection attempt may succeed if repeated:
// PostgreSQL did not answer (no SQLSTATE: refused or reset TCP, DNS, timeout), or refused for
// a passing reason: starting up, shutting down or in recovery (57P03), terminated by a shutdown
// (57P01, 57P02), out of connection slots or other resources (class 53), or a connection
// exception (class 08).
func TransientConnectError(err error) bool {
	code := SQLState(err)
	switch {
	case code == "":
		return true
	case code == "57P01", code == "57P02", code == "57P03":
		return true
	case strings.HasPrefix(code, "53"), strings.HasPrefix(code, "08"):
		return true
	}
	return false
}

// connectError explains a failed connection: for a refusal waiting cannot change, what was
// refused and what to fix; otherwise that PostgreSQL could not be reached.
func connectError(host string, port uint16, database, user string, err error) error {
	at := redact(host, port, database)
	code := SQLState(err)
	switch {
	case code == "3D000":
		return fmt.Errorf("PostgreSQL at %s has no database %q: %w (create it, or fix the database name in DATABASE_URL)", at, database, err)
	case strings.HasPrefix(code, "28"):
		return fmt.Errorf("PostgreSQL at %s refused the login of role %q: %w (check the user and password in DATABASE_URL, and pg_hba.conf)", at, user, err)
	case code == "42501":
		return fmt.Errorf("PostgreSQL at %s refused role %q: %w (GRANT CONNECT on the database to it)", at, user, err)
	case code != "" && !TransientConnectError(err):
		return fmt.Errorf("PostgreSQL at %s refused the connection: %w", at, err)
	}
	return fmt.Errorf("cannot reach PostgreSQL at %s: %w (is it running? `make run` starts a private cluster; DATABASE_URL overrides)", at, err)
}
