package visibility

// The visibility outbox: short committed claims with a lease. listen.go wakes the workers;
// sweep.go repairs the queue from buzz.visibility_state (the truth).

import (
	"context"
	crand "crypto/rand"
	"fmt"
	"sort"
	"time"

	"github.com/buzzpg/buzzpg/listener"
)

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
	ctx, cancel := listener.ClaimContext(ctx)
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

// maxChunk bounds how many fresh viewers one claim, and so one publication transaction, covers
// (plus up to a quarter more in backoff; the state row locks of a chunk are held until its commit).
const maxChunk = 32
