package visibility

import (
	"context"
	"time"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// publishChunk publishes a chunk of claimed viewers with one consistent read and one transaction
// (see publishMany). Whatever does not come back 'published' or 'stale' from the batch (a 'retry',
// a viewer whose snapshot must wait for the clock, or every item when the batch failed) goes
// through the single-viewer path, which re-reads, retries and backs off on its own.
func (p *Publisher) publishChunk(ctx context.Context, chunk []claimed) {
	wctx, cancel := context.WithTimeout(context.WithValue(ctx, publisherKey{}, p.cfg.InstanceID), p.cfg.Lease)
	defer cancel()
	single := chunk
	if srcs, ok := p.chunkSources(wctx, chunk); ok {
		var items []signedItem
		var itemClaims []claimed
		items, itemClaims, single = p.signChunk(chunk, srcs)
		if len(items) > 0 {
			hooks.At(wctx, HookBeforeFence)
			outcomes, err := publishMany(wctx, p.pool, items)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				p.log.Warn("batched snapshot publication failed; publishing one by one", "viewers", len(items), "err", err)
				single = append(single, itemClaims...)
			} else {
				single = append(single, p.settleBatch(items, itemClaims, outcomes)...)
			}
		}
	}
	for _, c := range single {
		if ctx.Err() != nil {
			return
		}
		p.handle(ctx, c)
	}
}

// chunkSources returns each claimed viewer's source: those the claim read, the rest in one more
// statement. ok is false when that statement failed.
func (p *Publisher) chunkSources(ctx context.Context, chunk []claimed) (srcs map[string]Source, ok bool) {
	srcs = make(map[string]Source, len(chunk))
	var missing []string
	for _, c := range chunk {
		if c.src != nil {
			srcs[c.viewer] = *c.src
		} else {
			missing = append(missing, c.viewer)
		}
	}
	if len(missing) == 0 {
		return srcs, true
	}
	more, err := ReadSources(ctx, p.pool, missing)
	if err != nil {
		p.log.Warn("batched visibility read failed; publishing one by one", "err", err)
		return nil, false
	}
	for v, s := range more {
		srcs[v] = s
	}
	return srcs, true
}

// signChunk builds and signs the snapshot of every viewer that can be published now; single are
// those that cannot (no source, a clock to wait for, a signing error).
func (p *Publisher) signChunk(chunk []claimed, srcs map[string]Source) (items []signedItem, itemClaims, single []claimed) {
	for _, c := range chunk {
		src, ok := srcs[c.viewer]
		createdAt, wait := src.CreatedAt()
		if !ok || wait > 0 {
			single = append(single, c)
			continue
		}
		ev := BuildSnapshot(c.viewer, src.Hidden, createdAt)
		if err := ev.Sign(p.cfg.RelaySecretKey); err != nil {
			single = append(single, c)
			continue
		}
		body, _ := ev.MarshalJSON()
		items = append(items, signedItem{viewer: c.viewer, generation: src.Generation, ev: ev, body: string(body)})
		itemClaims = append(itemClaims, c)
	}
	return items, itemClaims, single
}

// settleBatch records the outcome of each item of a committed batch and returns the claims the
// single-viewer path must take over.
func (p *Publisher) settleBatch(items []signedItem, itemClaims []claimed, outcomes []string) (single []claimed) {
	for i, out := range outcomes {
		it, c := items[i], itemClaims[i]
		if out == OutcomeBusy {
			single = append(single, c) // someone holds the row: publish it alone, waiting
			continue
		}
		p.count(out)
		p.log.Debug("snapshot "+out, "viewer", it.viewer, "generation", it.generation,
			"created_at", int64(it.ev.CreatedAt), "id", it.ev.ID)
		switch out {
		case OutcomePublished:
			if p.onPublished != nil {
				p.onPublished(it.viewer)
			}
			metrics.ConvergeSeconds.Observe((c.pending + time.Since(c.claimedAt)).Seconds())
			p.finish(c)
		case OutcomeStale:
			p.finish(c)
		default:
			single = append(single, c)
		}
	}
	return single
}

// handle publishes one claimed viewer through PublishViewer; a failure releases the row with
// backoff.
func (p *Publisher) handle(ctx context.Context, c claimed) {
	// Work past the lease would race the next claimer for nothing (the fence keeps it correct).
	wctx, cancel := context.WithTimeout(ctx, p.cfg.Lease)
	defer cancel()
	outcome, err := p.PublishViewer(wctx, c.viewer)
	if err != nil {
		if ctx.Err() != nil {
			return // shutting down: Close gives the row back without backoff
		}
		p.stats.failed.Add(1)
		metrics.Publications.WithLabelValues("failed").Inc()
		// A database outage fails every viewer: one line per 10 s, with the count.
		if log, folded := p.failLog.Allow(time.Now()); log {
			p.log.Warn("snapshot publication failed; backing off", "viewer", c.viewer,
				"attempts", c.attempts+1, "retry_in", p.backoffDelay(c.attempts), "err", err,
				"similar_since_last", folded)
		}
		// Tests stop the publisher here: it decided to release, shutdown may cut in.
		hooks.At(context.WithValue(ctx, publisherKey{}, p.cfg.InstanceID), HookBeforeRelease)
		// A release that fails while stopping leaves the claim to Close; at any other time the
		// lease takes care of the row (keeping the claim would grow p.claims with every blip).
		if p.release(ctx, c, err) || ctx.Err() == nil {
			p.finish(c)
		}
		return
	}
	if outcome == OutcomePublished {
		metrics.ConvergeSeconds.Observe((c.pending + time.Since(c.claimedAt)).Seconds())
	}
	p.finish(c)
}
