package listener

// The visibility outbox: a dedicated LISTEN connection that wakes the workers, sweeps that repair
// the queue from buzz.visibility_state (the truth), and short committed claims with a lease.

import (
	"context"
	crand "crypto/rand"
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// Querier is what the snapshot helpers need of a pool, connection or transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// HookListenReconnect is the pause point before a lost LISTEN connection is re-established.
const HookListenReconnect = "visibility.listen_reconnect"

// NotifyChannel is the channel the outbox trigger notifies (constant payload).
const NotifyChannel = "buzz_visibility"

// ListenAppName is the application_name of a publisher's LISTEN connection, so operators and tests
// can find (and pg_terminate_backend) it.
func ListenAppName(instance string) string { return "buzzpg-visibility-listen:" + instance }

// claimed is one outbox row this process holds under claim id claim until its lease ends.
type claimed struct {
	viewer     string
	generation int64
	attempts   int
	pending    time.Duration // age of the change when claimed (database clock)
	claimedAt  time.Time
	claim      string
	src        *Source // read by the claim statement itself; nil when it cannot be used
}

func newClaimID() string {
	var b [16]byte
	_, _ = crand.Read(b[:])
	b[6] = (b[6] & 0x0f) | 0x40
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// claimBatch claims up to size available rows in its own (autocommit) statement: no row lock
// survives it, the lease and claim id are the only hold. The same statement also reads each
// claimed viewer's visibility source (one round trip less per change): all of them from the
// statement's one snapshot, so each generation is paired with its own hidden set. That snapshot
// predates the claim's UPDATE, so a source older than the claimed row is not used (src = nil).
func (p *Publisher) claimBatch(ctx context.Context, size int) ([]claimed, error) {
	id := newClaimID()
	ctx, cancel := claimContext(ctx)
	defer cancel()
	rows, err := p.pool.Query(ctx, `
		SELECT c.viewer, c.generation, c.attempts, c.pending_seconds,
		       s.generation, s.hidden::text[], s.created_at_floor, buzz.now_unix(),
		       coalesce(buzz.cfg('snapshot_max_ahead_seconds'), '10')::bigint
		  FROM buzz.claim_visibility_work($1::uuid, $2, $3) c
		 CROSS JOIN LATERAL buzz.visibility_source(c.viewer) s`, id, size, p.cfg.Lease)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	var out []claimed
	for rows.Next() {
		c := claimed{claim: id, claimedAt: now}
		var pending float64
		var s Source
		if err := rows.Scan(&c.viewer, &c.generation, &c.attempts, &pending,
			&s.Generation, &s.Hidden, &s.Floor, &s.DBNow, &s.MaxAhead); err != nil {
			rows.Close()
			p.undoClaim(ctx, id, out, err)
			return nil, err
		}
		c.pending = time.Duration(pending * float64(time.Second))
		if s.Generation >= c.generation {
			sort.Strings(s.Hidden)
			c.src = &s
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		// The claim may have committed with its rows lost on the way (a dropped connection, or
		// a stop that outlasted claimGrace): give back whatever is held under its id.
		p.undoClaim(ctx, id, out, err)
		return nil, err
	}
	if len(out) > 0 {
		p.mu.Lock()
		p.claims[id] += len(out)
		p.mu.Unlock()
	}
	return out, nil
}

// finish forgets one row of a claim (published, stale, or released with backoff).
func (p *Publisher) finish(c claimed) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.claims[c.claim]--; p.claims[c.claim] <= 0 {
		delete(p.claims, c.claim)
	}
}

// backoffDelay mirrors buzz.release_visibility_claim: least(max, base * 2^attempts).
func (p *Publisher) backoffDelay(attempts int) time.Duration {
	d := p.cfg.BackoffBase
	for i := 0; i < attempts && d < p.cfg.BackoffMax; i++ {
		d *= 2
	}
	return min(d, p.cfg.BackoffMax)
}

// release gives a row back after a failed publication, with backoff, and schedules a local drain
// for when it is due (other processes find it with their periodic sweep).
// It reports whether the row was given back.
func (p *Publisher) release(ctx context.Context, c claimed, cause error) bool {
	var ok bool
	err := p.pool.QueryRow(ctx, `SELECT buzz.release_visibility_claim($1, $2::uuid, $3, $4, $5)`,
		c.viewer, c.claim, cause.Error(), p.cfg.BackoffBase, p.cfg.BackoffMax).Scan(&ok)
	if err != nil {
		// When stopping, Close tries again; failing that, the lease expires and any listener
		// re-takes the row.
		p.log.Warn("snapshot claim release failed", "viewer", c.viewer, "err", err)
		return false
	}
	delay := p.backoffDelay(c.attempts)
	time.AfterFunc(delay, p.kickDrain)
	return true
}

// sweep repairs the queue from the state (pending viewers without an outbox row get one) and
// refreshes the lag gauges. Draining follows.
func (p *Publisher) sweep(ctx context.Context) {
	p.stats.sweeps.Add(1)
	var repaired int
	if err := p.pool.QueryRow(ctx, `SELECT buzz.sweep_visibility()`).Scan(&repaired); err != nil {
		if ctx.Err() == nil {
			p.log.Warn("visibility sweep failed", "err", err)
		}
		return
	}
	if repaired > 0 {
		p.stats.repaired.Add(int64(repaired))
		p.log.Info("visibility sweep re-created outbox rows from the state", "rows", repaired)
	}
	// Rows in backoff (or under a lease) wake nobody when they come due: their NOTIFY fired long
	// ago, perhaps to a process that is gone. Wake a worker then, if that is before the next sweep.
	var due *float64
	if err := p.pool.QueryRow(ctx, `SELECT extract(epoch FROM min(greatest(available_at, coalesce(lease_until, available_at))) - now())
		FROM buzz.visibility_outbox WHERE available_at > now() OR lease_until > now()`).Scan(&due); err == nil && due != nil {
		if d := time.Duration(*due*float64(time.Second)) + time.Millisecond; d < p.cfg.SweepInterval {
			time.AfterFunc(d, p.kickDrain)
		}
	}
	var pending int64
	var oldest *float64
	if err := p.pool.QueryRow(ctx, `SELECT pending_viewers, oldest_pending_seconds FROM buzz.visibility_lag()`).
		Scan(&pending, &oldest); err == nil {
		metrics.OutboxDepth.Set(float64(pending))
		if oldest != nil {
			metrics.OutboxOldestSeconds.Set(*oldest)
		} else {
			metrics.OutboxOldestSeconds.Set(0)
		}
	}
}

// maxChunk bounds how many fresh viewers one claim, and so one publication transaction, covers
// (plus up to a quarter more in backoff; the state row locks of a chunk are held until its commit).
const maxChunk = 32

func (p *Publisher) kickDrain() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Publisher) kickSweep() {
	select {
	case p.sweepNow <- struct{}{}:
	default:
	}
}

// listenLoop owns the LISTEN connection: connect, LISTEN, ask for a full sweep (anything that
// arrived while nobody listened), then forward notifications; reconnect with backoff forever.
func (p *Publisher) listenLoop(ctx context.Context) {
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := p.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		p.log.Warn("visibility LISTEN connection lost; reconnecting", "err", err)
		if p.listenUp.Load() {
			delay = 100 * time.Millisecond
		}
		p.listenUp.Store(false)
		// Jittered, capped backoff so processes that lost the server together come back spread out.
		d := delay/2 + time.Duration(rand.Int64N(int64(delay/2)+1))
		delay = min(delay*2, 5*time.Second)
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
		// Tests hold the reconnect here to commit work while nobody listens.
		hooks.At(ctx, HookListenReconnect)
	}
}

func (p *Publisher) listenOnce(ctx context.Context) error {
	var cfg *pgx.ConnConfig
	var err error
	if p.cfg.DatabaseURL != "" {
		if cfg, err = pgx.ParseConfig(p.cfg.DatabaseURL); err != nil {
			return err
		}
	} else {
		cfg = p.pool.Config().ConnConfig.Copy()
	}
	cfg.RuntimeParams["application_name"] = ListenAppName(p.cfg.InstanceID)
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	conn, err := pgx.ConnectConfig(cctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+NotifyChannel); err != nil {
		return err
	}
	p.listenUp.Store(true)
	p.stats.listenConnects.Add(1)
	// LISTEN first, then sweep: whatever committed before the LISTEN is found by the sweep, what
	// commits after it notifies.
	p.kickSweep()
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		p.kickDrain()
	}
}
