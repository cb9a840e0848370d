// Package fanout is the fan-out: a logical-replication tail (pglogrepl, pgoutput) that hands every
// stored event, every ephemeral event and every reminder due signal of the whole deployment to
// this process's relay.
package fanout

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/logx"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/listener"
)

// Config configures the replication tail of one process.
type Config struct {
	DatabaseURL string        // replication connection adds replication=database
	InstanceID  string        // slot name buzz_<instance id> (sanitised to [a-z0-9_], <= 63 chars)
	StaleAfter  time.Duration // drop slots of instances silent longer than this; default 60s
	Heartbeat   time.Duration // default 5s
	Logger      *slog.Logger

	// Optional.
	ListenAddr        string        // recorded in buzz.instances for operators
	SlotCreateTimeout time.Duration // default 30s; on timeout the blocking sessions are logged
	StatusInterval    time.Duration // how often the consumed position is acknowledged; default 1s
	DedupeWindow      int           // ids remembered for de-duplication; default 65536
}

// Fanout tails buzz.events inserts and 'buzz' logical messages through this process's own
// named replication slot and hands each one to the sink exactly once.
type Fanout struct {
	cfg  Config
	pool *pgxpool.Pool
	sink evt.Sink
	log  *slog.Logger
	slot string

	ready      atomic.Bool
	lagNanos   atomic.Int64 // delay between commit and hand-off of the last handled transaction
	lastCommit atomic.Int64 // unix nanos of its commit
	handing    atomic.Int64 // commit time (unix nanos) of the transaction being handed over, 0 between

	// Stream state, touched only by the Run goroutine (and by Close after Run returned).
	lastEnd  pglogrepl.LSN // end of the last transaction handed to the sink (or keepalive position)
	seen     *recentKeys
	inflight txnProgress // the transaction being handed over; kept across a broken session
	hadSlot  bool

	// Counters (tests and metrics).
	deliveredN atomic.Int64 // events and due signals handed to the sink
	skippedTxn atomic.Int64 // whole transactions skipped because they ended at or before lastEnd
	skippedDup atomic.Int64 // single deliveries skipped by (transaction, id)
	sessions   atomic.Int64 // replication sessions attached
	slotsMade  atomic.Int64 // slots this process created (more than one: its slot was lost once)
	// changes of a transaction a broken session was handing over, skipped on its resend
	skippedResent atomic.Int64

	rejectLog logx.Sampler // logical messages ignored (verify.go): one line per interval

	// slotMade is closed once this process's slot exists: from then on every commit reaches our
	// connections (the slot retains it), so serve opens the WebSocket endpoint only after it.
	slotMade chan struct{}
	slotOnce sync.Once

	runner listener.Runner

	// owns says this process created the slot or attached it at least once. Only then does Close
	// remove the slot and the instance row: a second process started with the same instance id
	// finds the slot, never attaches (55006), and must not take the first one's row and slot
	// away when it stops (review finding: the owner's slot became an orphan, was reaped, and
	// its subscribers missed what was committed until it made a new one).
	owns atomic.Bool
	// attachedAt is when the last session attached (Run's goroutine only): how long it lasted
	// decides whether the backoff starts over.
	attachedAt time.Time

	// startHook, when set (tests), chooses the LSN a session asks the server to start from.
	startHook func(last pglogrepl.LSN) pglogrepl.LSN
	// attachedHook, when set (tests), runs in each session right after START_REPLICATION.
	attachedHook func()
	// waitHook, when set (tests), replaces the reconnect backoff's sleep (backoff.sleep).
	waitHook func(base time.Duration) bool
}

// New prepares a fan-out; Run starts it.
func New(cfg Config, pool *pgxpool.Pool, sink evt.Sink) *Fanout {
	if cfg.StaleAfter <= 0 {
		cfg.StaleAfter = 60 * time.Second
	}
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = 5 * time.Second
	}
	// A live process must beat several times within StaleAfter, or others would take it for dead
	// during a mere reconnect; this also keeps the reaping bound near StaleAfter.
	if cfg.Heartbeat > cfg.StaleAfter/3 {
		cfg.Heartbeat = cfg.StaleAfter / 3
	}
	if cfg.SlotCreateTimeout <= 0 {
		cfg.SlotCreateTimeout = 30 * time.Second
	}
	if cfg.StatusInterval <= 0 {
		cfg.StatusInterval = time.Second
	}
	if cfg.DedupeWindow <= 0 {
		cfg.DedupeWindow = 1 << 16
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	slot := SlotName(cfg.InstanceID)
	return &Fanout{
		cfg: cfg, pool: pool, sink: sink, slot: slot,
		log:       log.With("component", "fanout", "slot", slot),
		seen:      newRecentKeys(cfg.DedupeWindow),
		rejectLog: logx.Sampler{Every: 10 * time.Second},
		slotMade:  make(chan struct{}),
	}
}

// SlotReady is closed once this process's replication slot exists (created, or found after a
// restart with the same instance id). A subscription registered before that could miss events
// committed before the slot's starting point: nothing would retain them for this process.
func (f *Fanout) SlotReady() <-chan struct{} { return f.slotMade }

// Ready reports whether the replication stream is attached.
func (f *Fanout) Ready() bool { return f.ready.Load() }

// Lag is how far behind commit the fan-out is: while attached, the delay between the commit of
// the last handled transaction and its hand-off to the sink; while detached, the time since that
// commit (everything committed since is waiting).
func (f *Fanout) Lag() time.Duration {
	if f.ready.Load() {
		lag := time.Duration(f.lagNanos.Load())
		// A hand-off that does not finish (the sink waits, e.g. retrying a member lookup) shows
		// as a growing lag, not as the last finished transaction's.
		if c := f.handing.Load(); c != 0 {
			lag = max(lag, time.Since(time.Unix(0, c)))
		}
		return lag
	}
	if c := f.lastCommit.Load(); c != 0 {
		return time.Since(time.Unix(0, c))
	}
	return 0
}

// Run streams until ctx ends (or Close), reconnecting with capped backoff after any error. It
// returns nil when stopped, and an error only for what retrying cannot fix (wal_level, a role
// without the REPLICATION attribute).
func (f *Fanout) Run(ctx context.Context) error {
	ctx, finish, ok := f.runner.Start(ctx)
	if !ok {
		return errors.New("fanout: Run called twice or after Close")
	}
	defer finish()

	bo := newBackoff()
	for {
		err := CheckWalLevel(ctx, f.pool)
		var wl *WalLevelError
		if errors.As(err, &wl) {
			return err
		}
		if err == nil {
			break
		}
		f.log.Warn("fan-out cannot reach PostgreSQL; retrying", "err", err)
		if !bo.wait(ctx) {
			return nil
		}
	}

	hbDone := make(chan struct{})
	hbCtx, stopHeartbeat := context.WithCancel(ctx)
	go func() { defer close(hbDone); f.heartbeatLoop(hbCtx) }()
	defer func() { stopHeartbeat(); <-hbDone }() // also on a fatal return: stop heart-beating first

	if f.waitHook != nil {
		bo.sleep = f.waitHook
	}
	for {
		attached, err := f.stream(ctx)
		if ctx.Err() != nil {
			return nil
		}
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege: retrying cannot help
			return fmt.Errorf("fan-out: %w: the database role needs the REPLICATION attribute (ALTER ROLE <role> REPLICATION) to stream changes and manage slots", err)
		}
		var elsewhere *SlotElsewhereError
		if errors.As(err, &elsewhere) { // nor can it here
			return fmt.Errorf("fan-out: %w", err)
		}
		// Only a session that lasted starts the backoff over: one that fails right after attaching
		// every time (a WAL segment gone, a message that cannot be decoded) would otherwise
		// reconnect ten times a second for good (review finding).
		if attached && time.Since(f.attachedAt) >= stableSession {
			bo.reset()
		}
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: the slot is streaming to someone else
			// Either another process runs with this BUZZ_INSTANCE_ID (two processes cannot share a
			// slot; this one stays unready until the other stops), or this instance's previous
			// process is still attached and its walsender ends within wal_sender_timeout.
			f.log.Error("fan-out replication slot is in use by another connection: is another process running with this BUZZ_INSTANCE_ID? retrying",
				"err", err, "instance", f.cfg.InstanceID)
		} else {
			f.log.Warn("fan-out replication stream lost; reconnecting", "err", err, "resume_lsn", f.lastEnd.String())
		}
		metrics.FanoutReconnects.Inc()
		if !bo.wait(ctx) {
			return nil
		}
	}
}

// Close stops Run and removes this instance's traces: its slot (a graceful shutdown must not pin
// WAL until a reaper notices) and its instance row.
func (f *Fanout) Close(ctx context.Context) error {
	if err := f.runner.Stop(ctx); err != nil {
		return err
	}
	if !f.owns.Load() {
		f.log.Warn("fan-out closed without removing the slot and the instance row: this process neither created nor attached them (is another process running with this BUZZ_INSTANCE_ID?)",
			"instance", f.cfg.InstanceID)
		return nil
	}
	// The row goes first: a slot without an instance row is an orphan that any live process
	// drops as soon as it is inactive, while one with a row waits out StaleAfter. Dropped after
	// the slot, the row would get only what the drop left of ctx, and a slot still held by our
	// walsender (it has not noticed the closed connection yet) uses all of it.
	_, err := f.pool.Exec(ctx, `DELETE FROM buzz.instances WHERE instance_id = $1`, f.cfg.InstanceID)
	if e := dropSlot(ctx, f.pool, f.slot); err == nil {
		err = e
	}
	if err == nil {
		f.log.Info("fan-out closed; slot dropped")
	}
	return err
}
