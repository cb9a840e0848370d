package relay

import (
	"context"
	"errors"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// lookupMembers reads member sets on the query pool within the client's share of it, like a query
// (queryConn): REQs naming many channels must not let one client hold more of the pool than that.
// Sets all in the cache cost nothing: a busy client's REQs naming its DMs do not wait for its share.
func (c *conn) lookupMembers(ctx context.Context, channels []string) (map[string][]string, error) {
	if sets, ok := c.s.members.cached(channels); ok {
		return sets, nil
	}
	if !c.s.ipQueries.acquire(ctx, c.ip) {
		return nil, ctx.Err()
	}
	defer c.s.ipQueries.release(c.ip)
	return c.s.members.membersOf(ctx, c.s.query, channels)
}

func (c *conn) acquireQuery(ctx context.Context) bool {
	select {
	case c.querySem <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *conn) releaseQuery() { <-c.querySem }

// queryConn takes one of the client's share of the query pool (ipQueries), then a connection.
// The share is held while the query runs and its rows are read, not while they are sent: a
// client reading slowly must not hold its office's share.
func (c *conn) queryConn(ctx context.Context) (pc *pgxpool.Conn, release func(), err error) {
	if !c.s.ipQueries.acquire(ctx, c.ip) {
		return nil, nil, ctx.Err()
	}
	pc, err = c.s.acquireQueryConn(ctx)
	if err != nil {
		c.s.ipQueries.release(c.ip)
		return nil, nil, err
	}
	return pc, func() { pc.Release(); c.s.ipQueries.release(c.ip) }, nil
}

// runQuery runs a query of verb (REQ, COUNT) on a query connection within the query timeout,
// and records its duration, the wait for the connection included.
func (c *conn) runQuery(ctx context.Context, verb string, query func(context.Context, *pgxpool.Conn) error) error {
	ctx, cancel := context.WithTimeout(ctx, c.s.cfg.QueryTimeout)
	defer cancel()
	start := time.Now()
	defer func() { metrics.Queries.WithLabelValues(verb).Observe(time.Since(start).Seconds()) }()
	pc, release, err := c.queryConn(ctx)
	if err != nil {
		return err
	}
	defer release()
	return query(ctx, pc)
}

// recoverQuery answers a query goroutine's panic with CLOSED. sub is the REQ's subscription (nil
// for COUNT): a CLOSED subscription must not go on delivering live events, and a COUNT's CLOSED
// ends a REQ of its id (closeID).
func (c *conn) recoverQuery(subID string, sub *subscription) {
	if p := recover(); p != nil {
		c.log.Error("panic in query", "sub", subID, "panic", p, "stack", string(debug.Stack()))
		if sub == nil {
			c.closeID(subID, "error: internal error")
			return
		}
		if sub.ctx.Err() != nil {
			return // closed or replaced: a CLOSED now would name its successor
		}
		c.endSub(sub, "error: internal error")
	}
}

// abandonTx ends a transaction an error left open on pc (a statement timeout, say), so the
// connection goes back to the pool instead of being dropped by it and opened again (under
// overload, when timeouts come, that would add a backend start to each). A closed connection
// is left to the pool.
func abandonTx(pc *pgxpool.Conn) {
	if pc.Conn().IsClosed() || pc.Conn().PgConn().TxStatus() == 'I' {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, _ = pc.Exec(ctx, `ROLLBACK`)
}

// acquireQueryConn takes a query-pool connection whose session statement_timeout is the query
// timeout. The context deadline already cancels a query from Go; the server-side timeout also
// ends it when the cancel request cannot reach PostgreSQL. Set once per physical connection.
func (s *Server) acquireQueryConn(ctx context.Context) (*pgxpool.Conn, error) {
	pc, err := s.query.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	key := pc.Conn().PgConn()
	if _, done := s.timeoutSet.Load(key); !done {
		ms := strconv.FormatInt(s.cfg.QueryTimeout.Milliseconds(), 10)
		if _, err := pc.Exec(ctx, `SELECT set_config('statement_timeout', $1, false)`, ms); err != nil {
			pc.Release()
			return nil, err
		}
		if s.timeoutSetLen.Add(1) > 10000 {
			// Closed connections leave entries behind; forgetting all of them only costs one
			// more set_config per live connection.
			s.timeoutSet.Clear()
			s.timeoutSetLen.Store(0)
		}
		s.timeoutSet.Store(key, struct{}{})
	}
	return pc, nil
}

func isTimeout(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "57014" { // query_canceled (statement_timeout)
		return true
	}
	return errors.Is(err, context.DeadlineExceeded)
}

func queryErrorReason(err error) string {
	if isTimeout(err) {
		return "error: query timed out"
	}
	return "error: query failed"
}
