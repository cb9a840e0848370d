// Package visibility is the NIP-DV publisher: it drains the visibility outbox and publishes each
// viewer's kind 30622 snapshot through the database fence (docs/design.md, invariants I2, I3, I4).
// Several publishers in several processes share the work; none needs to trust another, because
// the fence is checked by PostgreSQL (buzz.publish_visibility_snapshot), not by a lock a process
// holds.
package visibility

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/logx"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

// Config configures one process's snapshot publisher.
type Config struct {
	InstanceID     string
	RelaySecretKey string        // hex; signs 30622
	SweepInterval  time.Duration // default 3s
	Lease          time.Duration // default 30s: a claim not finished by then is anyone's again
	BackoffBase    time.Duration // default 200ms
	BackoffMax     time.Duration // default 1m
	BatchSize      int           // rows per claim; default 100, each claim capped at 32 (one transaction)
	Workers        int           // concurrent publications; default 4
	Logger         *slog.Logger
	DatabaseURL    string // for the dedicated LISTEN connection (default: the pool's config)

	// PollInterval, when > 0, also drains on this tick (an empty claim is one cheap index probe
	// that writes nothing). It lets a deployment drop the outbox NOTIFY trigger, whose commits
	// PostgreSQL serialises cluster-wide (see the benchmark). 0: off, NOTIFY and sweeps only.
	PollInterval time.Duration
}

// Publisher drains the visibility outbox of one process.
type Publisher struct {
	cfg  Config
	pool *pgxpool.Pool
	log  *slog.Logger
	pub  string // relay pubkey (hex)

	failLog logx.Sampler // publication failures: one line per interval during an outage

	wake     chan struct{} // an idle worker claims now (notification, poll, due backoff, sweep)
	sweepNow chan struct{} // repair, then wake (LISTEN (re)connected)
	listenUp atomic.Bool

	mu     sync.Mutex
	claims map[string]int // claim id -> rows still held by this process
	runner listener.Runner

	onPublished func(viewer string) // tests and benchmarks: after a 'published' commit

	stats struct { // read by tests
		published, stale, retry, failed  atomic.Int64
		sweeps, repaired, listenConnects atomic.Int64
	}
}

// NewPublisher returns a publisher; Run starts it. The pool should allow Workers + 2 connections.
func NewPublisher(cfg Config, pool *pgxpool.Pool) *Publisher {
	if cfg.SweepInterval <= 0 {
		cfg.SweepInterval = 3 * time.Second
	}
	if cfg.Lease <= 0 {
		cfg.Lease = 30 * time.Second
	}
	if cfg.BackoffBase <= 0 {
		cfg.BackoffBase = 200 * time.Millisecond
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = time.Minute
	}
	if cfg.BackoffMax < cfg.BackoffBase {
		cfg.BackoffMax = cfg.BackoffBase
	}
	if cfg.BatchSize <= 0 {
		cfg.BatchSize = 100
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 4
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	p := &Publisher{
		cfg:      cfg,
		pool:     pool,
		log:      cfg.Logger.With("component", "snapshot-publisher"),
		wake:     make(chan struct{}, 1),
		sweepNow: make(chan struct{}, 1),
		claims:   map[string]int{},
		failLog:  logx.Sampler{Every: 10 * time.Second},
	}
	p.pub, _ = nostr.GetPublicKey(cfg.RelaySecretKey)
	return p
}

// Run LISTENs, sweeps the whole backlog (at start and after every reconnect), then publishes on
// notifications and periodic sweeps until ctx ends or Close. Returns nil when stopped.
func (p *Publisher) Run(ctx context.Context) error {
	if p.pub == "" {
		return errors.New("snapshot publisher: invalid relay secret key")
	}
	ctx, finish, ok := p.runner.Start(ctx)
	if !ok {
		return errors.New("snapshot publisher: Run called twice or after Close")
	}
	defer finish()

	var cfgKey string
	if err := p.pool.QueryRow(ctx, `SELECT coalesce(buzz.cfg('relay_pubkey'), '')`).Scan(&cfgKey); err == nil && cfgKey != p.pub {
		// publish_visibility_snapshot rejects snapshots by any other key (BZ400), so every
		// publication would fail and back off until serve records the key.
		p.log.Error("buzz.config relay_pubkey is not this publisher's key; snapshots will be rejected",
			"config", cfgKey, "key", p.pub)
	}

	var wg sync.WaitGroup
	for i := 0; i < p.cfg.Workers; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); p.worker(ctx) }()
	}
	wg.Add(1)
	go func() { defer wg.Done(); p.listenLoop(ctx) }()

	p.log.Info("snapshot publisher started", "workers", p.cfg.Workers, "sweep_interval", p.cfg.SweepInterval,
		"lease", p.cfg.Lease, "backoff_max", p.cfg.BackoffMax)
	tick := time.NewTicker(p.cfg.SweepInterval)
	defer tick.Stop()
	var poll <-chan time.Time
	if p.cfg.PollInterval > 0 {
		pt := time.NewTicker(p.cfg.PollInterval)
		defer pt.Stop()
		poll = pt.C
	}
	for {
		select {
		case <-poll:
			p.kickDrain()
		case <-ctx.Done():
			wg.Wait()
			return nil
		case <-p.sweepNow:
			p.sweep(ctx)
			p.kickDrain()
		case <-tick.C:
			p.sweep(ctx)
			p.kickDrain()
		}
	}
}

// worker pulls work: woken, it claims up to one chunk and publishes it, and goes on claiming
// until the queue is empty. Under load every worker is busy while changes pile up in the outbox,
// so the next claim takes many rows and publishes them with ONE commit; at low load an idle
// worker takes each change at once (each notification wakes one). A full claim wakes another.
func (p *Publisher) worker(ctx context.Context) {
	size := min(p.cfg.BatchSize, maxChunk)
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.wake:
		}
		for ctx.Err() == nil {
			batch, err := p.claimBatch(ctx, size)
			if err != nil {
				if ctx.Err() == nil {
					p.log.Warn("visibility claim failed", "err", err)
				}
				break
			}
			if len(batch) == 0 {
				break
			}
			if ctx.Err() != nil {
				return // stopped while claiming: Close gives the batch back
			}
			metrics.SnapshotClaimViewers.Observe(float64(len(batch)))
			if len(batch) >= size { // a claim may add rows in backoff on top of size
				p.kickDrain() // probably more waiting: wake another idle worker
			}
			sort.Slice(batch, func(i, j int) bool { return batch[i].viewer < batch[j].viewer })
			p.publishChunk(ctx, batch)
		}
	}
}

// Close stops Run and gives back, without backoff, every row this process still holds, so
// another listener takes it at once (their NOTIFY trigger fires on the release).
func (p *Publisher) Close(ctx context.Context) error {
	if err := p.runner.Stop(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	ids := make([]string, 0, len(p.claims))
	for id := range p.claims {
		ids = append(ids, id)
	}
	p.claims = map[string]int{}
	p.mu.Unlock()
	if len(ids) == 0 {
		return nil
	}
	var n int
	if err := p.pool.QueryRow(ctx, `SELECT buzz.release_visibility_claims($1::uuid[])`, ids).Scan(&n); err != nil {
		return fmt.Errorf("release snapshot claims: %w", err)
	}
	p.log.Info("snapshot publisher released its claims", "rows", n)
	return nil
}
