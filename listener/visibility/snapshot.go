package visibility

// NIP-DV snapshot building: one consistent read of a viewer's visibility source, a kind 30622
// event signed with the relay key, and the database-fenced publication
// (buzz.visibility_source / buzz.publish_visibility_snapshot in sql/0003_visibility.up.sql).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// KindVisibilitySnapshot is NIP-DV's per-viewer snapshot, signed by the relay key.
const KindVisibilitySnapshot = 30622

// Publication outcomes returned by buzz.publish_visibility_snapshot.
const (
	OutcomePublished = "published" // the event is the viewer's head now
	OutcomeStale     = "stale"     // a generation >= ours was already published: nothing to do
	OutcomeRetry     = "retry"     // created_at not above the head (or too far ahead): re-read
)

// HookBeforeFence is the pause point between reading the source and the fenced publication, so a
// test can hold a publisher with a stale generation while the state moves on.
const HookBeforeFence = "publish.before_fence"

// HookBeforeRelease is the pause point between a failed publication and giving its row back.
const HookBeforeRelease = "publish.before_release"

// maxRetries bounds 'retry' loops of one PublishViewer call (each one re-reads the source); the
// worker then releases the claim with backoff and the row comes back later.
const maxRetries = 16

// Source is one consistent read of what a viewer's snapshot must say, plus the database clock.
type Source struct {
	Generation int64
	Hidden     []string // hidden DM channel ids, sorted
	Floor      int64    // created_at of the newest 30622 for this viewer by any key (0: none)
	DBNow      int64    // database clock, unix seconds
	MaxAhead   int64    // snapshot_max_ahead_seconds
}

// CreatedAt is the snapshot's created_at: max(db now, floor + 1), and how long to wait for the
// database clock first when that is more than MaxAhead ahead of it (the protocol's promise).
func (s Source) CreatedAt() (createdAt int64, wait time.Duration) {
	createdAt = max(s.DBNow, s.Floor+1)
	if over := createdAt - s.DBNow - s.MaxAhead; over > 0 {
		return createdAt, time.Duration(over) * time.Second
	}
	return createdAt, 0
}

// ReadSource reads buzz.visibility_source(viewer) (one statement, one snapshot) with the clock.
func ReadSource(ctx context.Context, q Querier, viewer string) (Source, error) {
	var s Source
	err := q.QueryRow(ctx, `
		SELECT s.generation, s.hidden::text[], s.created_at_floor, buzz.now_unix(),
		       coalesce(buzz.cfg('snapshot_max_ahead_seconds'), '10')::bigint
		  FROM buzz.visibility_source($1) s`, viewer).
		Scan(&s.Generation, &s.Hidden, &s.Floor, &s.DBNow, &s.MaxAhead)
	if err != nil {
		return s, fmt.Errorf("visibility_source: %w", err)
	}
	sort.Strings(s.Hidden)
	return s, nil
}

// ReadSources is ReadSource for many viewers in ONE statement (one snapshot for all of them, so
// each viewer's generation is still paired with its own hidden set).
func ReadSources(ctx context.Context, q Querier, viewers []string) (map[string]Source, error) {
	rows, err := q.Query(ctx, `
		SELECT v.viewer, s.generation, s.hidden::text[], s.created_at_floor, buzz.now_unix(),
		       coalesce(buzz.cfg('snapshot_max_ahead_seconds'), '10')::bigint
		  FROM unnest($1::text[]) v(viewer), LATERAL buzz.visibility_source(v.viewer) s`, viewers)
	if err != nil {
		return nil, fmt.Errorf("visibility_source: %w", err)
	}
	defer rows.Close()
	out := make(map[string]Source, len(viewers))
	for rows.Next() {
		var v string
		var s Source
		if err := rows.Scan(&v, &s.Generation, &s.Hidden, &s.Floor, &s.DBNow, &s.MaxAhead); err != nil {
			return nil, err
		}
		sort.Strings(s.Hidden)
		out[v] = s
	}
	return out, rows.Err()
}

// BuildSnapshot returns the unsigned NIP-DV event for viewer: d = p = viewer, one h per hidden DM.
func BuildSnapshot(viewer string, hidden []string, createdAt int64) *nostr.Event {
	tags := make(nostr.Tags, 0, 2+len(hidden))
	tags = append(tags, nostr.Tag{"d", viewer}, nostr.Tag{"p", viewer})
	for _, h := range hidden {
		tags = append(tags, nostr.Tag{"h", h})
	}
	return &nostr.Event{Kind: KindVisibilitySnapshot, CreatedAt: nostr.Timestamp(createdAt), Tags: tags, Content: ""}
}

// PublishSigned calls buzz.publish_visibility_snapshot for an event already signed by the relay
// key, retrying deadlocks and serialization failures (the call is one transaction).
func PublishSigned(ctx context.Context, q Querier, viewer string, generation int64, ev *nostr.Event) (string, error) {
	body, err := json.Marshal(ev)
	if err != nil {
		return "", err
	}
	var outcome string
	err = db.Retry(ctx, func(ctx context.Context) error {
		return q.QueryRow(ctx, `SELECT buzz.publish_visibility_snapshot($1, $2, $3::jsonb)`,
			viewer, generation, string(body)).Scan(&outcome)
	})
	if err != nil {
		if aboveTarget(err) {
			return OutcomeRetry, nil
		}
		return "", fmt.Errorf("publish_visibility_snapshot: %w", err)
	}
	return outcome, nil
}

// aboveTarget reports a publication refused by visibility_state_published_le_target: its
// generation was read before the viewer's state row was deleted and started again, so it is
// above anything the state has now. Re-reading finds the new generation.
func aboveTarget(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23514" && pgErr.ConstraintName == "visibility_state_published_le_target"
}

// signedItem is one viewer's snapshot ready for the fence.
type signedItem struct {
	viewer     string
	generation int64
	ev         *nostr.Event
	body       string
}

// OutcomeBusy (batch form only): the viewer's state row was locked by another transaction, so
// the batch skipped it rather than wait; nothing changed.
const OutcomeBusy = "busy"

// publishMany publishes every item in ONE transaction and one round trip with
// buzz.publish_visibility_snapshots: one commit for the lot (commits are what this machine runs out
// of first). Each viewer keeps its own fence and 'retry' subtransaction; a viewer whose state row
// is busy is skipped (never waited for while holding others, so no deadlocks). Any error rolls
// back the whole batch: the caller then publishes the items one by one to isolate the failure.
func publishMany(ctx context.Context, q Querier, items []signedItem) ([]string, error) {
	viewers := make([]string, len(items))
	gens := make([]int64, len(items))
	bodies := make([]string, len(items))
	for i, it := range items {
		viewers[i], gens[i], bodies[i] = it.viewer, it.generation, it.body
	}
	outcomes := make([]string, len(items))
	err := db.Retry(ctx, func(ctx context.Context) error {
		rows, err := q.Query(ctx, `SELECT outcome FROM buzz.publish_visibility_snapshots($1::text[], $2::bigint[], $3::jsonb[])`,
			viewers, gens, bodies)
		if err != nil {
			return err
		}
		defer rows.Close()
		i := 0
		for rows.Next() {
			if i >= len(outcomes) {
				return errors.New("publish_visibility_snapshots: more rows than viewers")
			}
			if err := rows.Scan(&outcomes[i]); err != nil {
				return err
			}
			i++
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if i != len(outcomes) {
			return fmt.Errorf("publish_visibility_snapshots: %d outcomes for %d viewers", i, len(outcomes))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("publish_visibility_snapshots (batch of %d): %w", len(items), err)
	}
	return outcomes, nil
}

// PublishViewer brings viewer's published snapshot to the current target generation: read the
// source, build and sign, publish fenced; on 'retry' read again. Returns 'published' or 'stale'
// ('stale' means someone already published this generation or a newer one: also done).
func (p *Publisher) PublishViewer(ctx context.Context, viewer string) (string, error) {
	ctx = context.WithValue(ctx, publisherKey{}, p.cfg.InstanceID)
	for attempt := 0; attempt < maxRetries; {
		src, err := ReadSource(ctx, p.pool, viewer)
		if err != nil {
			return "", err
		}
		createdAt, wait := src.CreatedAt()
		if wait > 0 {
			// Never drift further than MaxAhead from the database clock: wait for it, then re-read
			// (the target may have moved meanwhile, which is fine: we publish the newest state).
			p.log.Info("snapshot would run ahead of the database clock; waiting", "viewer", viewer, "wait", wait)
			select {
			case <-ctx.Done():
				return "", ctx.Err()
			case <-time.After(wait):
			}
			continue
		}
		ev := BuildSnapshot(viewer, src.Hidden, createdAt)
		if err := ev.Sign(p.cfg.RelaySecretKey); err != nil {
			return "", fmt.Errorf("sign snapshot: %w", err)
		}
		hooks.At(ctx, HookBeforeFence)
		outcome, err := PublishSigned(ctx, p.pool, viewer, src.Generation, ev)
		if err != nil {
			return "", err
		}
		p.count(outcome)
		p.log.Debug("snapshot "+outcome, "viewer", viewer, "generation", src.Generation,
			"created_at", createdAt, "hidden", len(src.Hidden), "id", ev.ID)
		if outcome == OutcomePublished && p.onPublished != nil {
			p.onPublished(viewer)
		}
		switch outcome {
		case OutcomePublished, OutcomeStale:
			return outcome, nil
		case OutcomeRetry:
			attempt++
			continue
		default:
			return "", fmt.Errorf("publish_visibility_snapshot: unexpected outcome %q", outcome)
		}
	}
	return "", errors.New("snapshot publication kept answering 'retry'")
}

func (p *Publisher) count(outcome string) {
	metrics.Publications.WithLabelValues(outcome).Inc()
	switch outcome {
	case OutcomePublished:
		p.stats.published.Add(1)
	case OutcomeStale:
		p.stats.stale.Add(1)
	case OutcomeRetry:
		p.stats.retry.Add(1)
	}
}

// publisherKey carries the publisher's InstanceID in the context of its hook points, so a test can
// stop one publisher of several (export_test.go).
type publisherKey struct{}

// Querier is what the snapshot helpers need of a pool, connection or transaction.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}
