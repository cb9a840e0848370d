package main

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/listener/fanout"
	"github.com/buzzpg/buzzpg/listener/reminders"
	"github.com/buzzpg/buzzpg/listener/upkeep"
	"github.com/buzzpg/buzzpg/listener/visibility"
	"github.com/buzzpg/buzzpg/relay"
)

// build opens the pools, writes the shared settings, binds the listen address and makes the
// components; nothing runs yet.
func (s *server) build() error {
	if err := s.openPools(); err != nil {
		return err
	}
	if err := publishSettings(s.ctx, s.accept, s.pk, s.cfg, s.log); err != nil {
		return err
	}
	if err := s.warmAccept(); err != nil {
		return err
	}
	if err := s.listen(); err != nil {
		return err
	}
	if !s.cfg.NoRelay {
		var err error
		if s.relay, err = s.newRelay(); err != nil {
			return err
		}
		s.fanout = s.newFanout()
	}
	s.publisher = s.newPublisher()
	s.scheduler = s.newScheduler()
	s.http = s.newHTTP()
	return nil
}

// warmsAccept reports whether the acceptance pool keeps connections warmed for accept_event.
func (s *server) warmsAccept() bool { return !s.cfg.NoRelay && s.cfg.AcceptConnsMin > 0 }

// openPools opens the five pools, and waits for the schema on the first.
func (s *server) openPools() (err error) {
	var warm []db.PoolOption
	if s.warmsAccept() {
		warm = append(warm, store.WarmAccept(int32(s.cfg.AcceptConnsMin)))
	}
	if s.accept, err = s.openPool("accept", int32(s.cfg.AcceptConns), warm...); err != nil {
		return err
	}
	if err := waitForSchema(s.ctx, s.accept, s.log); err != nil {
		return err
	}
	if s.query, err = s.openPool("query", int32(s.cfg.QueryConns), db.QuerySessions); err != nil {
		return err
	}
	// The publisher (4 workers and its sweep: 5), the scheduler (1) and the fan-out (stream and
	// heartbeat: 2) share it. At shutdown each gives its claims back or drops its slot only once
	// its own Run has returned and let go of its connections, so even with the two others stuck
	// holding theirs, the three release steps running side by side find connections free: they
	// never wait for one another.
	if s.lpool, err = s.openPool("listener", 12); err != nil {
		return err
	}
	// Live delivery's member-set lookups: rare (sets are cached), but the one fan-out goroutine
	// waits for each, so they do not queue behind client traffic on the acceptance pool.
	if s.lookup, err = s.openPool("lookup", 2); err != nil {
		return err
	}
	// /readyz's own connection: probes must not queue behind client traffic on the acceptance
	// pool, where a saturated pool would read as "database unreachable".
	s.health, err = s.openPool("health", 1)
	return err
}

// openPool opens pool name (application_name buzzpg-<name>:<instance>), closed with the others.
func (s *server) openPool(name string, size int32, opts ...db.PoolOption) (*pgxpool.Pool, error) {
	p, err := db.NewPool(s.ctx, s.cfg.DatabaseURL, "buzzpg-"+name+":"+s.cfg.InstanceID, size, opts...)
	if err != nil {
		return nil, err
	}
	s.pools.add(name, p)
	return p, nil
}

// warmAccept opens the acceptance pool's minimum of warmed connections before serving.
func (s *server) warmAccept() error {
	if !s.warmsAccept() {
		return nil
	}
	began := time.Now()
	n := min(s.cfg.AcceptConnsMin, s.cfg.AcceptConns)
	if err := store.Warm(s.ctx, s.accept, n); err != nil {
		return err
	}
	s.log.Debug("accept connections warmed", "conns", n, "took", time.Since(began))
	return nil
}

// listen binds the client address, now that the process can serve.
func (s *server) listen() error {
	ln, err := net.Listen("tcp", s.cfg.Listen)
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w (set BUZZ_LISTEN to a free address)", s.cfg.Listen, err)
	}
	s.ln = ln
	s.addr = ln.Addr().String()
	if s.cfg.RelayURL == "" {
		s.cfg.RelayURL = defaultRelayURL(s.cfg.Listen, s.addr)
	}
	return nil
}

// newRelay makes the WebSocket server; live delivery's member-set lookups use their own pool.
func (s *server) newRelay() (*relay.Server, error) {
	cfg := s.cfg
	srv, err := relay.New(relay.Config{
		RelayURL:              cfg.RelayURL,
		RelaySecretKey:        s.sk,
		Name:                  "buzzpg",
		Description:           "team chat relay; durable side effects in PostgreSQL",
		MaxFutureSeconds:      cfg.MaxFutureSeconds,
		QueryTimeout:          cfg.QueryTimeout,
		ReminderHorizon:       cfg.ReminderHorizon,
		EventRate:             cfg.EventRate,
		EventBurst:            cfg.EventBurst,
		ReqRate:               cfg.ReqRate,
		ReqBurst:              cfg.ReqBurst,
		IPEventRate:           cfg.IPEventRate,
		IPReqRate:             cfg.IPReqRate,
		MaxConns:              cfg.MaxConns,
		MaxConnsPerIP:         cfg.IPMaxConns,
		MaxSubscriptionsPerIP: cfg.IPMaxSubs,
		MaxSubscriptionsTotal: cfg.MaxSubs,
		DedupBytes:            int64(cfg.DedupMB) << 20,
		InboxEvents:           cfg.InboxEvents,
		InboxEventsPerIP:      cfg.IPInboxEvents,
		DeliveryRatePerIP:     orUnlimited(cfg.IPDeliveryRate),
		DeliveryBurstPerIP:    cfg.IPDeliveryBurst,
		TrustedProxies:        cfg.TrustedProxies,
		InitialResultBudget:   int64(cfg.ResultBudgetMB) << 20,
		InitialResultPerIP:    int64(cfg.ResultIPShareMB) << 20,
		SendBudget:            int64(cfg.SendBudgetMB) << 20,
		SendClientShare:       int64(cfg.SendIPShareMB) << 20,
		AcceptBatch:           cfg.AcceptBatch,
		AcceptBatchCalls:      cfg.AcceptBatchCalls,
		EventWindow:           cfg.EventWindow,
		Logger:                s.log,
	}, s.accept, s.query)
	if err != nil {
		return nil, err
	}
	srv.SetLookupPool(s.lookup)
	return srv, nil
}

// newFanout makes the fan-out, which delivers committed events to the relay's subscribers.
func (s *server) newFanout() *fanout.Fanout {
	return fanout.New(fanout.Config{
		DatabaseURL: s.cfg.DatabaseURL,
		InstanceID:  s.cfg.InstanceID,
		StaleAfter:  s.cfg.SlotStaleAfter,
		Logger:      s.log,
	}, s.lpool, s.relay)
}

// newPublisher makes the visibility snapshot publisher.
func (s *server) newPublisher() *visibility.Publisher {
	return visibility.NewPublisher(visibility.Config{
		InstanceID:     s.cfg.InstanceID,
		RelaySecretKey: s.sk,
		SweepInterval:  s.cfg.SweepInterval,
		Lease:          s.cfg.Lease,
		BackoffMax:     s.cfg.BackoffMax,
		Logger:         s.log,
		DatabaseURL:    s.cfg.DatabaseURL,
	}, s.lpool)
}

// newScheduler makes the reminder scheduler.
func (s *server) newScheduler() *reminders.Scheduler {
	return reminders.NewScheduler(reminders.Config{
		InstanceID:  s.cfg.InstanceID,
		Lease:       s.cfg.ReminderLease,
		BatchSize:   s.cfg.ReminderBatch,
		Logger:      s.log,
		DatabaseURL: s.cfg.DatabaseURL,
	}, s.lpool)
}

// newUpkeep makes the background purge (one process of the deployment runs it at a time).
func (s *server) newUpkeep() *upkeep.Upkeep {
	return upkeep.New(upkeep.Config{
		DatabaseURL:  s.cfg.DatabaseURL,
		InstanceID:   s.cfg.InstanceID,
		Interval:     s.cfg.UpkeepInterval,
		Batch:        s.cfg.UpkeepBatch,
		Pause:        s.cfg.UpkeepPause,
		Grace:        s.cfg.UpkeepGrace,
		ReminderKeep: s.cfg.UpkeepReminderKeep,
		Logger:       s.log,
	})
}

// newHTTP makes the client listener's server (health, readiness, the relay) and hands the
// readiness check to the operator listener.
func (s *server) newHTTP() *http.Server {
	serveDebug(s.cfg.DebugListen, s.log)
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	s.readiness = newReady(s.health, s.fanout)
	ready := s.readiness.check
	s.opsReady.Store(&ready)
	// Metrics stay off this listener (BUZZ_METRICS_LISTEN): counters that move when a message
	// resurfaces a DM would tell anyone that somebody had hidden it.
	mux.HandleFunc("/readyz", publicReadyz(ready))
	if s.relay != nil {
		mux.Handle("/", untilSlot(s.fanout.SlotReady(), s.relay))
	}
	// IdleTimeout: a keep-alive connection (after /healthz, NIP-11 or a refused upgrade) holds
	// a file descriptor and counts against no cap; upgraded WebSockets are not affected.
	return &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 60 * time.Second}
}

// orUnlimited maps a rate of 0 (unlimited, as the flags say) to the relay's negative one (its 0
// takes the default).
func orUnlimited(rate float64) float64 {
	if rate == 0 {
		return -1
	}
	return rate
}
