package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/store"
	// The package is aliased: serve names its fan-out variable fanout.
	fanoutpkg "github.com/buzzpg/buzzpg/listener/fanout"
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

func serve(cfg serveConfig, log *slog.Logger) (err error) {
	sk, pk, err := loadRelayKey(cfg.RelayKey, cfg.RelayKeyFile)
	if err != nil {
		return err
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// A signal during start-up is the operator stopping the process, not a failure: whatever step
	// it cut short (waiting for PostgreSQL, for a migration, opening pools) ends with the
	// cancellation, which is no news. Exit 0, as a stop after start-up does; an error that is not
	// the cancellation itself (a migration that failed as the signal came) keeps its exit code.
	serving := false
	defer func() {
		if err == nil || serving || ctx.Err() == nil {
			return
		}
		if !errors.Is(err, context.Canceled) {
			// A step that failed on its own as the signal came (a migration that failed,
			// leaving the version dirty) is still a failure: a deploy tool must see it.
			return
		}
		log.Info("stopped during start-up", "reason", "signal")
		err = nil
	}()
	// After the first signal a second one takes the default action: the operator who sends it
	// wants out now. Claims then sit out their leases and peers reap the slot, nothing worse.
	// Not during migrations (they take no context): a kill there leaves the version dirty, and
	// every process refuses to start until someone forces it; the first signal ends start-up
	// right after them.
	migrating, migrated := make(chan struct{}), make(chan struct{})
	defer func() {
		select {
		case <-migrated:
		default:
			close(migrated)
		}
	}()
	go func() {
		<-ctx.Done()
		select {
		case <-migrated:
		default:
			select {
			case <-migrating:
				// Else the signal would seem ignored for as long as the migrations take.
				log.Info("stopping once the migrations running now have ended", "reason", "signal")
			default:
			}
			<-migrated
		}
		stop()
	}()

	// What can be refused without changing the database is checked first: a busy port or a
	// server without logical decoding must not leave migrations or settings behind. The port is
	// only probed here and bound once the process can serve, so that clients and TCP health
	// checks are refused, not left hanging in the backlog, while it starts.
	if err := probeListen(cfg.Listen); err != nil {
		return err
	}
	// The operator listener serves from now on: /metrics is useful while start-up waits (for
	// PostgreSQL, for migrations), and its /readyz says what it waits for.
	var opsReady atomic.Pointer[func(context.Context) (string, error)]
	if cfg.MetricsListen != "" {
		opsLn, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			return fmt.Errorf("cannot listen on %s: %w (set BUZZ_METRICS_LISTEN to a free address, or empty to turn it off)", cfg.MetricsListen, err)
		}
		opsSrv := serveOps(opsLn, &opsReady, log)
		defer func() { _ = opsSrv.Close() }()
	}
	if err := db.WaitReachable(ctx, cfg.DatabaseURL, cfg.DBWait, log); err != nil {
		return err
	}
	if err := checkWalLevel(ctx, cfg.DatabaseURL, !cfg.NoRelay); err != nil {
		return err
	}
	if cfg.AutoMigrate {
		hooks.At(ctx, hookBeforeMigrations)
		// Migrations take no context and, once begun, run to their end (see above): a signal that
		// came before them is honoured here, or they would run on a stop the operator asked for.
		if err := ctx.Err(); err != nil {
			close(migrated)
			return err
		}
		close(migrating)
		if err := db.MigrateUp(cfg.DatabaseURL, log); err != nil {
			// A newer schema is served as with auto-migrate off (checkSchema says so): an old
			// binary restarting during a rollout or a rollback must not crash-loop on it.
			var newer *db.SchemaNewerError
			if !errors.As(err, &newer) {
				close(migrated)
				return err
			}
			log.Warn("not migrating: the schema is newer than this binary", "schema_version", newer.Have, "binary_version", newer.Latest)
		}
	}
	close(migrated)
	var warm []db.PoolOption
	if !cfg.NoRelay && cfg.AcceptConnsMin > 0 {
		warm = append(warm, store.WarmAccept(int32(cfg.AcceptConnsMin)))
	}
	// Closed together, within poolCloseGrace, however start-up or shutdown ends.
	var pools poolSet
	defer pools.close(log)
	accept, err := db.NewPool(ctx, cfg.DatabaseURL, "buzzpg-accept:"+cfg.InstanceID, int32(cfg.AcceptConns), warm...)
	if err != nil {
		return err
	}
	pools.add("accept", accept)
	if err := waitForSchema(ctx, accept, log); err != nil {
		return err
	}
	query, err := db.NewPool(ctx, cfg.DatabaseURL, "buzzpg-query:"+cfg.InstanceID, int32(cfg.QueryConns))
	if err != nil {
		return err
	}
	pools.add("query", query)
	// The publisher (4 workers and its sweep: 5), the scheduler (1) and the fan-out (stream and
	// heartbeat: 2) share it. At shutdown each gives its claims back or drops its slot only once
	// its own Run has returned and let go of its connections, so even with the two others stuck
	// holding theirs, the three release steps running side by side find connections free: they
	// never wait for one another.
	lpool, err := db.NewPool(ctx, cfg.DatabaseURL, "buzzpg-listener:"+cfg.InstanceID, 12)
	if err != nil {
		return err
	}
	pools.add("listener", lpool)
	// Live delivery's member-set lookups: rare (sets are cached), but the one fan-out goroutine
	// waits for each, so they do not queue behind client traffic on the acceptance pool.
	lookup, err := db.NewPool(ctx, cfg.DatabaseURL, "buzzpg-lookup:"+cfg.InstanceID, 2)
	if err != nil {
		return err
	}
	pools.add("lookup", lookup)
	// /readyz's own connection: probes must not queue behind client traffic on the acceptance
	// pool, where a saturated pool would read as "database unreachable".
	health, err := db.NewPool(ctx, cfg.DatabaseURL, "buzzpg-health:"+cfg.InstanceID, 1)
	if err != nil {
		return err
	}
	pools.add("health", health)
	if err := publishSettings(ctx, accept, pk, cfg, log); err != nil {
		return err
	}
	if len(warm) > 0 {
		began := time.Now()
		n := min(cfg.AcceptConnsMin, cfg.AcceptConns)
		if err := store.Warm(ctx, accept, n); err != nil {
			return err
		}
		log.Debug("accept connections warmed", "conns", n, "took", time.Since(began))
	}

	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w (set BUZZ_LISTEN to a free address)", cfg.Listen, err)
	}
	defer ln.Close()
	addr := ln.Addr().String()
	if cfg.RelayURL == "" {
		cfg.RelayURL = defaultRelayURL(cfg.Listen, addr)
	}

	var (
		srv    *relay.Server
		fanout *fanoutpkg.Fanout
	)
	if !cfg.NoRelay {
		srv, err = relay.New(relay.Config{
			RelayURL:              cfg.RelayURL,
			RelaySecretKey:        sk,
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
			TrustedProxies:        cfg.TrustedProxies,
			InitialResultBudget:   int64(cfg.ResultBudgetMB) << 20,
			InitialResultPerIP:    int64(cfg.ResultIPShareMB) << 20,
			SendBudget:            int64(cfg.SendBudgetMB) << 20,
			SendClientShare:       int64(cfg.SendIPShareMB) << 20,
			AcceptBatch:           cfg.AcceptBatch,
			AcceptBatchCalls:      cfg.AcceptBatchCalls,
			Logger:                log,
		}, accept, query)
		if err != nil {
			return err
		}
		srv.SetLookupPool(lookup)
		fanout = fanoutpkg.New(fanoutpkg.Config{
			DatabaseURL: cfg.DatabaseURL,
			InstanceID:  cfg.InstanceID,
			StaleAfter:  cfg.SlotStaleAfter,
			Logger:      log,
		}, lpool, srv)
	}
	publisher := visibility.NewPublisher(visibility.Config{
		InstanceID:     cfg.InstanceID,
		RelaySecretKey: sk,
		SweepInterval:  cfg.SweepInterval,
		Lease:          cfg.Lease,
		BackoffMax:     cfg.BackoffMax,
		Logger:         log,
		DatabaseURL:    cfg.DatabaseURL,
	}, lpool)
	scheduler := reminders.NewScheduler(reminders.Config{
		InstanceID:  cfg.InstanceID,
		Lease:       cfg.ReminderLease,
		BatchSize:   cfg.ReminderBatch,
		Logger:      log,
		DatabaseURL: cfg.DatabaseURL,
	}, lpool)

	serveDebug(cfg.DebugListen, log)
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	readiness := newReady(health, fanout)
	ready := readiness.check
	opsReady.Store(&ready)
	// Metrics stay off this listener (BUZZ_METRICS_LISTEN): counters that move when a message
	// resurfaces a DM would tell anyone that somebody had hidden it.
	mux.HandleFunc("/readyz", publicReadyz(ready))
	if srv != nil {
		mux.Handle("/", untilSlot(fanout.SlotReady(), srv))
	}
	// IdleTimeout: a keep-alive connection (after /healthz, NIP-11 or a refused upgrade) holds
	// a file descriptor and counts against no cap; upgraded WebSockets are not affected.
	httpSrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 60 * time.Second}

	// Components run until ctx ends; a component that fails for good stops the process.
	compCtx, cancelComps := context.WithCancel(context.Background())
	defer cancelComps()
	failed := make(chan error, 4)
	var wg sync.WaitGroup
	runComp := func(name string, run func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(compCtx); err != nil && !errors.Is(err, context.Canceled) {
				failed <- fmt.Errorf("%s: %w", name, err)
			}
		}()
	}
	if fanout != nil {
		runComp("fanout", fanout.Run)
	}
	runComp("publisher", publisher.Run)
	runComp("reminders", scheduler.Run)
	go func() {
		if err := httpSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			failed <- fmt.Errorf("http: %w", err)
		}
	}()
	if fanout != nil {
		metrics.RegisterFanout(fanout.Ready, fanout.Lag)
	}
	serving = true
	log.Info("listening", "addr", addr, "relay_url", cfg.RelayURL, "relay_pubkey", pk, "relay", !cfg.NoRelay)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-failed:
	}
	stop() // a component failure starts the shutdown too: a signal from now on ends it at once
	// Unready from the first moment of the drain: the operator's /readyz (and a public probe on
	// a kept-alive connection) must not report "ready" while clients are being closed.
	readiness.closing.Store(true)
	hooks.At(context.Background(), hookShutdownBegun)
	if runErr != nil {
		log.Error("component failed; shutting down", "err", runErr)
	} else {
		log.Info("shutting down; a second signal stops at once", "reason", "signal", "grace", cfg.ShutdownGrace,
			"bound", shutdownBound(cfg.ShutdownGrace))
	}

	// Graceful: stop accepting, close client connections, release claims and leases, drop the slot.
	// Every step waits for at most its own grace, so the whole fits shutdownBound (see shutdown.go).
	sctx, cancel := context.WithTimeout(context.Background(), cfg.ShutdownGrace)
	defer cancel()
	_ = httpSrv.Shutdown(sctx)
	if srv != nil {
		_ = srv.Shutdown(sctx)
	}
	cancelComps()
	if !finishedWithin(componentStopGrace, wg.Wait) {
		// E.g. the scheduler resolving a commit whose outcome is unknown (it may take up to its
		// lease). The Close of a stuck component gives up after its own few seconds, and what
		// it holds waits out its lease; the others still give their claims back.
		log.Warn("components did not stop in time; closing the others", "waited", componentStopGrace)
	}
	releases := []releaseStep{{"publisher", publisher.Close}, {"scheduler", scheduler.Close}}
	if fanout != nil {
		releases = append(releases, releaseStep{"fanout", fanout.Close})
	}
	release(releases, log)
	log.Info("stopped")
	return runErr
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

// checkSchema refuses to serve a database whose schema is missing, dirty or older than this
// binary needs, with what to do about it. A newer schema is served: during a rolling deploy the
// migrations run first and the old binaries keep serving until they are replaced.
//
// Dirty has two meanings. golang-migrate, under its advisory lock, records (N, dirty) and commits
// it, runs file N in one transaction, then records (N, clean): while the lock is held, dirty is a
// migration in progress, and the schema still the one below N (a down from N+1 records (N, dirty)
// first: counting it as N-1 is then one too low, which can only make a process less ready). Once
// the lock is gone, dirty is a migration that failed. A schema too old while a migration runs is
// reported as errMigrating, which start-up waits out.
func checkSchema(ctx context.Context, pool *pgxpool.Pool) error {
	var version int64
	var dirty bool
	err := pool.QueryRow(ctx, `SELECT version, dirty FROM `+db.MigrationsTable+` LIMIT 1`).Scan(&version, &dirty)
	if err != nil {
		if ctx.Err() != nil {
			// Cut short (a signal at start-up, a probe's timeout): no news about the schema.
			return fmt.Errorf("schema: cannot read %s: %w", db.MigrationsTable, err)
		}
		return fmt.Errorf("schema: cannot read %s (%v): apply migrations with `buzzpg migrate up` or start with BUZZ_AUTO_MIGRATE=true", db.MigrationsTable, err)
	}
	latest := int64(db.LatestVersion())
	if !dirty && version >= latest {
		return nil
	}
	hooks.At(ctx, hookSchemaRead)
	running, err := db.MigrationRunning(ctx, pool)
	if err != nil {
		return fmt.Errorf("schema: at version %d (dirty: %v), and cannot tell from pg_locks whether a migration is running: %w", version, dirty, err)
	}
	if dirty && !running {
		// The migrator commits (N, clean) and only then gives its lock back: a migration that
		// ended between our two reads shows as dirty with no lock held. Read again, now that the
		// lock is seen free, before calling it failed.
		var v2 int64
		var d2 bool
		hooks.At(ctx, hookSchemaReread)
		if err := pool.QueryRow(ctx, `SELECT version, dirty FROM `+db.MigrationsTable+` LIMIT 1`).Scan(&v2, &d2); err != nil {
			// Not read: no news, and certainly not proof of a failed migration (a signal here
			// must not turn into "run migrate force").
			return fmt.Errorf("schema: cannot read %s again: %w", db.MigrationsTable, err)
		}
		if v2 != version || !d2 {
			return checkSchema(ctx, pool)
		}
		return fmt.Errorf("schema: %s", db.DirtyAdvice(int(version)))
	}
	effective := version
	if dirty {
		effective = version - 1
	}
	switch {
	case effective >= latest:
		return nil
	case running:
		return fmt.Errorf("schema: database is at version %d, this binary needs %d, and %w (golang-migrate's lock is held; %s says version %d, dirty %v)", effective, latest, errMigrating, db.MigrationsTable, version, dirty)
	}
	return fmt.Errorf("schema: database is at version %d, this binary needs %d: run `buzzpg migrate up`", version, latest)
}

// hookSchemaRead is where a test ends a migration between checkSchema's read of the version and
// its look at the lock.
const hookSchemaRead = "serve.schema_read"

// hookBeforeMigrations is just before auto-migrate begins, the last point a signal stops start-up
// without the schema changing.
const hookBeforeMigrations = "serve.before_migrations"

// hookSchemaReread is just before the second read of a version seen dirty with the lock free.
const hookSchemaReread = "serve.schema_reread"

// errMigrating marks a schema that is not current yet while a migration runs.
var errMigrating = errors.New("a migration is in progress")

// waitForSchema is checkSchema at start-up. A migration in progress (a deploy's `buzzpg migrate
// up`, a peer's auto-migrate) is waited for, up to the migrator's own lock timeout, instead of
// ending the start with advice about a failure that did not happen.
func waitForSchema(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	deadline := time.Now().Add(db.MigrateLockTimeout)
	for logged := false; ; logged = true {
		err := checkSchema(ctx, pool)
		if !errors.Is(err, errMigrating) {
			return err
		}
		if !logged {
			log.Warn("waiting for a migration in progress", "err", err, "for", db.MigrateLockTimeout)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w, for over %s: start this process again once it has finished (`buzzpg migrate version` says where it stands)", err, db.MigrateLockTimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// publishSettings records the settings SQL enforces too (buzz.config is shared by every process).
// The last process to start wins, so a replacement that differs from what another process wrote
// is said loudly: with a different relay key, the snapshots of processes still on the old key are
// refused from now on (a key rotation does this on purpose; a misconfigured replica by accident).
func publishSettings(ctx context.Context, pool *pgxpool.Pool, pk string, cfg serveConfig, log *slog.Logger) error {
	// settings_written_by names the last writer; before any process wrote, the values are the
	// migration's defaults and replacing them is no news, except a relay key: one is set only by
	// a process (deployments from before settings_written_by existed have a key but no writer).
	rows, err := pool.Query(ctx, `
		WITH prev AS (SELECT value AS writer FROM buzz.config WHERE key = 'settings_written_by'),
		     old AS (SELECT key, value FROM buzz.config
		              WHERE key IN ('relay_pubkey', 'max_future_seconds', 'reminder_horizon_seconds')),
		     up AS (INSERT INTO buzz.config(key, value) VALUES
		              ('relay_pubkey', $1), ('max_future_seconds', $2), ('reminder_horizon_seconds', $3),
		              ('settings_written_by', $4)
		            ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value
		            RETURNING key, value)
		SELECT up.key, old.value, up.value, coalesce((SELECT writer FROM prev), 'unknown')
		  FROM up JOIN old USING (key)
		 WHERE old.value IS DISTINCT FROM up.value
		   AND (EXISTS (SELECT 1 FROM prev) OR (up.key = 'relay_pubkey' AND old.value <> ''))`,
		pk, fmt.Sprint(cfg.MaxFutureSeconds), fmt.Sprint(int64(cfg.ReminderHorizon/time.Second)), cfg.InstanceID)
	if err != nil {
		return fmt.Errorf("cannot write buzz.config: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var key, was, now, writer string
		if err := rows.Scan(&key, &was, &now, &writer); err != nil {
			return fmt.Errorf("cannot write buzz.config: %w", err)
		}
		log.Warn("this process replaces a shared setting another process wrote; every process should run with the same value",
			"setting", key, "was", was, "now", now, "written_by", writer)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("cannot write buzz.config: %w", err)
	}
	return nil
}

// probeListen fails fast, before anything touches the database, when the listen address is taken.
func probeListen(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w (set BUZZ_LISTEN to a free address)", addr, err)
	}
	return ln.Close()
}

// checkWalLevel refuses a server without logical decoding before anything is written to it.
func checkWalLevel(ctx context.Context, url string, fanout bool) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if err := fanoutpkg.CheckWalLevel(ctx, conn); err != nil || !fanout {
		return err
	}
	// Checked here too, not only when the fan-out first streams: by then the process listens and
	// has written the deployment's settings into buzz.config, which a misconfigured process
	// should not do before it dies.
	// Asked of the server by opening a replication connection, not read from pg_roles: managed
	// services grant replication through a role of theirs (rds_replication on Amazon RDS) and
	// leave rolreplication false.
	var role string
	if err := conn.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		return err
	}
	rcfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return err
	}
	rcfg.RuntimeParams["replication"] = "database"
	rc, err := pgconn.ConnectConfig(ctx, rcfg)
	if err == nil {
		_, err = pglogrepl.IdentifySystem(ctx, rc)
		rc.Close(context.Background())
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" {
		return fmt.Errorf("the database role %q may not open replication connections, which the fan-out needs to stream changes and manage its slot (%s): ALTER ROLE %s REPLICATION, or on a managed service its replication role (e.g. GRANT rds_replication on Amazon RDS); or run the listener alone with --no-relay",
			role, pgErr.Message, pgx.Identifier{role}.Sanitize())
	}
	// Anything else (pg_hba.conf, the network) the fan-out reports, and retries, itself.
	return nil
}
