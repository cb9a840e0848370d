package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/relay"
)

// run starts the components and the client listener, and returns when ctx ends (nil) or a
// component fails for good (its error).
func (s *server) run() error {
	s.startComponents()
	go func() {
		if err := s.http.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.failed <- fmt.Errorf("http: %w", err)
		}
	}()
	if s.fanout != nil {
		metrics.RegisterFanout(s.fanout.Ready, s.fanout.Lag)
	}
	s.serving = true
	s.log.Info("listening", "addr", s.addr, "relay_url", s.cfg.RelayURL, "relay_pubkey", s.pk, "relay", !s.cfg.NoRelay,
		"signatures", relay.SignatureVerifier)
	select {
	case <-s.ctx.Done():
		return nil
	case err := <-s.failed:
		return err
	}
}

// startComponents runs each component until shutdown; one that fails for good stops the process.
func (s *server) startComponents() {
	ctx, cancel := context.WithCancel(context.Background())
	s.cancelComps = cancel
	s.failed = make(chan error, 8) // one per component and the HTTP server, so no sender blocks
	start := func(name string, run func(context.Context) error) {
		s.comps.Add(1)
		go func() {
			defer s.comps.Done()
			if err := run(ctx); err != nil && !errors.Is(err, context.Canceled) {
				s.failed <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}
	if s.fanout != nil {
		start("fanout", s.fanout.Run)
	}
	start("publisher", s.publisher.Run)
	start("reminders", s.scheduler.Run)
	start("upkeep", s.newUpkeep().Run)
	start("statistics", func(ctx context.Context) error {
		return store.RefreshStatistics(ctx, s.query, store.StatisticsEvery, s.log)
	})
}

// shutdown is graceful: stop accepting, close client connections, release claims and leases,
// drop the slot. Every step waits for at most its own grace, so the whole fits shutdownBound
// (see shutdown.go).
func (s *server) shutdown(runErr error) {
	s.stop() // a component failure starts the shutdown too: a signal from now on ends it at once
	// Unready from the first moment of the drain: the operator's /readyz (and a public probe on
	// a kept-alive connection) must not report "ready" while clients are being closed.
	s.readiness.closing.Store(true)
	hooks.At(context.Background(), hookShutdownBegun)
	if runErr != nil {
		s.log.Error("component failed; shutting down", "err", runErr)
	} else {
		s.log.Info("shutting down; a second signal stops at once", "reason", "signal", "grace", s.cfg.ShutdownGrace,
			"bound", shutdownBound(s.cfg.ShutdownGrace))
	}
	sctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownGrace)
	defer cancel()
	_ = s.http.Shutdown(sctx)
	if s.relay != nil {
		_ = s.relay.Shutdown(sctx)
	}
	s.cancelComps()
	if !finishedWithin(componentStopGrace, s.comps.Wait) {
		// E.g. the scheduler resolving a commit whose outcome is unknown (it may take up to its
		// lease). The Close of a stuck component gives up after its own few seconds, and what
		// it holds waits out its lease; the others still give their claims back.
		s.log.Warn("components did not stop in time; closing the others", "waited", componentStopGrace)
	}
	release(s.releaseSteps(), s.log)
	s.log.Info("stopped")
}

// releaseSteps gives back each component's claims, leases and slot.
func (s *server) releaseSteps() []releaseStep {
	steps := []releaseStep{{"publisher", s.publisher.Close}, {"scheduler", s.scheduler.Close}}
	if s.fanout != nil {
		steps = append(steps, releaseStep{"fanout", s.fanout.Close})
	}
	return steps
}
