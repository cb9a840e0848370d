package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
)

// WarmAccept keeps at least minConns connections in an accept pool, and runs accept_events and
// accept_event once on every new connection before the pool hands it out: for a synthetic kind 1 event, in a
// transaction that is rolled back, so nothing is stored, nothing is committed and the
// replication tails see nothing (aborted transactions are never sent).
//
// Why: a fresh backend pays for its connection, for compiling accept_event's PL/pgSQL and for
// planning each of its statements on first use, and pgx prepares the call once per connection.
// Left to the first clients, that lands on them: with cold pools, the first half second of a
// 250 events/s run had 81 OKs slower than 10 ms (worst 260 ms), the remaining 19.5 s a handful.
// The warm-up is best effort: a connection it fails on is still handed out (a missing schema is
// reported by the caller's own check, with its own advice).
func WarmAccept(minConns int32) db.PoolOption {
	return func(cfg *pgxpool.Config) {
		cfg.MinConns = min(minConns, cfg.MaxConns)
		cfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
			_ = warmConn(ctx, conn)
			return nil
		}
	}
}

// Warm opens n connections of pool at once (each warmed by WarmAccept's hook) and returns when
// they are ready, so a relay starts serving with them in place rather than filling the pool
// behind its first clients.
func Warm(ctx context.Context, pool *pgxpool.Pool, n int) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conns := make(chan *pgxpool.Conn, n)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Held until all are acquired, so the n acquisitions need n connections.
			c, err := pool.Acquire(ctx)
			if err != nil {
				errs <- err
				return
			}
			conns <- c
		}()
	}
	wg.Wait()
	close(conns)
	close(errs)
	for c := range conns {
		c.Release()
	}
	if err := <-errs; err != nil {
		return fmt.Errorf("opening the accept connections: %w", err)
	}
	return nil
}

func warmConn(ctx context.Context, conn *pgx.Conn) error {
	event := func() ([]byte, error) {
		return json.Marshal(map[string]any{
			"id": randomHex(32), "pubkey": randomHex(32), "sig": randomHex(64),
			"created_at": time.Now().Unix(), "kind": 1, "tags": [][]string{}, "content": "buzzpg warm-up (rolled back)",
		})
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the rollback is the point; an error leaves nothing behind either
	// Both paths: the single call first (what every schema has), then the batched one (0028), so
	// that on an older schema (a peer still migrating) the first is still warmed.
	raw, err := event()
	if err != nil {
		return err
	}
	var ok bool
	var msg string
	if err := tx.QueryRow(ctx, acceptSQL, string(raw)).Scan(&ok, &msg); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("synthetic event refused: %s", msg)
	}
	if raw, err = event(); err != nil {
		return err
	}
	var code *string
	if err := tx.QueryRow(ctx, acceptBatchSQL, "["+string(raw)+"]", BatchLockWait.Milliseconds()).Scan(&ok, &msg, &code); err != nil {
		return err
	}
	return tx.Rollback(ctx)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
