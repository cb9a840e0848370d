package visibility

// The dedicated LISTEN connection that wakes the workers, and the wake-ups themselves.

import (
	"context"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/hooks"
)

// HookListenReconnect is the pause point before a lost LISTEN connection is re-established.
const HookListenReconnect = "visibility.listen_reconnect"

// NotifyChannel is the channel the outbox trigger notifies (constant payload).
const NotifyChannel = "buzz_visibility"

// ListenAppName is the application_name of a publisher's LISTEN connection, so operators and tests
// can find (and pg_terminate_backend) it.
func ListenAppName(instance string) string { return "buzzpg-visibility-listen:" + instance }

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
