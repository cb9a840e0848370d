package main

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/listener/fanout"
	"github.com/buzzpg/buzzpg/listener/reminders"
	"github.com/buzzpg/buzzpg/listener/visibility"
	"github.com/buzzpg/buzzpg/relay"
)

func runServe(args []string) error {
	cfg, err := parseServeConfig(args)
	if err != nil {
		return err
	}
	log := newLogger(cfg.LogFormat, cfg.LogLevel).With("instance", cfg.InstanceID)
	slog.SetDefault(log)
	if err := serve(cfg, log); err != nil {
		// In the configured format, so a JSON log pipeline sees why the process ended.
		log.Error("serve failed", "err", err)
		return loggedError{err}
	}
	return nil
}

// loggedError is an error the command already logged; main only sets the exit code.
type loggedError struct{ error }

func (e loggedError) Unwrap() error { return e.error }

// server is one `buzzpg serve` process. serve runs its steps in order: start-up (checks that
// change nothing, migrations), build (pools, components), run, shutdown.
type server struct {
	cfg    serveConfig
	log    *slog.Logger
	sk, pk string

	ctx     context.Context    // ends at the first signal, or when a component fails
	stop    context.CancelFunc // ends ctx and restores the default signal action
	serving bool               // start-up is over: a signal from now on is a shutdown
	gate    migrationGate

	ops      *http.Server // the operator listener (nil when off)
	opsReady atomic.Pointer[func(context.Context) (string, error)]

	pools                                poolSet
	accept, query, lpool, lookup, health *pgxpool.Pool

	ln        net.Listener
	addr      string
	relay     *relay.Server  // nil with --no-relay
	fanout    *fanout.Fanout // nil with --no-relay
	publisher *visibility.Publisher
	scheduler *reminders.Scheduler
	readiness *ready
	http      *http.Server

	cancelComps context.CancelFunc // ends the components' context (at shutdown)
	comps       sync.WaitGroup
	failed      chan error // a component that failed for good
}

func serve(cfg serveConfig, log *slog.Logger) (err error) {
	s := &server{cfg: cfg, log: log}
	if s.sk, s.pk, err = loadRelayKey(cfg.RelayKey, cfg.RelayKeyFile); err != nil {
		return err
	}
	s.ctx, s.stop = signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer s.stop()
	defer s.signalDuringStartUpIsNoFailure(&err)
	s.gate = newMigrationGate()
	s.watchSecondSignal()
	defer s.close()
	if err := s.startUp(); err != nil {
		return err
	}
	if err := s.build(); err != nil {
		return err
	}
	runErr := s.run()
	s.shutdown(runErr)
	return runErr
}

// signalDuringStartUpIsNoFailure clears *err when a signal cut start-up short. A signal during
// start-up is the operator stopping the process, not a failure: whatever step it cut short
// (waiting for PostgreSQL, for a migration, opening pools) ends with the cancellation, which is
// no news. Exit 0, as a stop after start-up does; an error that is not the cancellation itself
// (a migration that failed as the signal came) keeps its exit code.
func (s *server) signalDuringStartUpIsNoFailure(err *error) {
	if *err == nil || s.serving || s.ctx.Err() == nil {
		return
	}
	if !errors.Is(*err, context.Canceled) {
		// A step that failed on its own as the signal came (a migration that failed,
		// leaving the version dirty) is still a failure: a deploy tool must see it.
		return
	}
	s.log.Info("stopped during start-up", "reason", "signal")
	*err = nil
}

// close lets go of what start-up and build took, the latest first, however serve ends. Pools
// close together, within poolCloseGrace.
func (s *server) close() {
	if s.cancelComps != nil {
		s.cancelComps()
	}
	if s.ln != nil {
		_ = s.ln.Close()
	}
	s.pools.close(s.log)
	if s.ops != nil {
		_ = s.ops.Close()
	}
	s.gate.end()
}

// defaultRelayURL is the NIP-42 relay URL when BUZZ_RELAY_URL is unset: ws:// + BUZZ_LISTEN as
// written (clients type the host the operator typed, e.g. localhost, not what it resolves to),
// with the chosen port when the port is 0. A wildcard host (":7777", "0.0.0.0:7777") names no
// URL a client could use: "" (serve refuses to start that way; see parseServeConfig).
func defaultRelayURL(listen, bound string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return "ws://" + bound
	}
	if wildcardHost(listen) {
		return ""
	}
	if port == "0" || port == "" {
		if _, p, err := net.SplitHostPort(bound); err == nil {
			port = p
		}
	}
	return "ws://" + net.JoinHostPort(host, port)
}

// wildcardHost reports whether listen binds every interface (":7777", "0.0.0.0:7777", "[::]:7777").
func wildcardHost(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "" || (ip != nil && ip.IsUnspecified())
}

// untilSlot answers 503 until the fan-out's replication slot exists. A client served before then
// could register a subscription whose live events nothing retains for this process: commits that
// land before the slot's starting point would never reach it. Creating the slot waits for every
// transaction open at that moment, so the window can last as long as the oldest one.
func untilSlot(ready <-chan struct{}, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-ready:
			next.ServeHTTP(w, r)
		default:
			w.Header().Set("Retry-After", "1")
			http.Error(w, "starting: the replication slot of this relay process is not created yet", http.StatusServiceUnavailable)
		}
	})
}
