package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
	fanoutpkg "github.com/buzzpg/buzzpg/listener/fanout"
)

// migrationGate tells the signal watcher whether auto-migrate is running.
type migrationGate struct {
	migrating, migrated chan struct{}
	once                *sync.Once
}

func newMigrationGate() migrationGate {
	return migrationGate{migrating: make(chan struct{}), migrated: make(chan struct{}), once: new(sync.Once)}
}

// end marks the migrations over (or never begun); later calls do nothing.
func (g migrationGate) end() { g.once.Do(func() { close(g.migrated) }) }

// watchSecondSignal makes a second signal take the default action: the operator who sends it
// wants out now. Claims then sit out their leases and peers reap the slot, nothing worse. Not
// during migrations (they take no context): a kill there leaves the version dirty, and every
// process refuses to start until someone forces it; the first signal ends start-up right after
// them.
func (s *server) watchSecondSignal() {
	go func() {
		<-s.ctx.Done()
		select {
		case <-s.gate.migrated:
		default:
			select {
			case <-s.gate.migrating:
				// Else the signal would seem ignored for as long as the migrations take.
				s.log.Info("stopping once the migrations running now have ended", "reason", "signal")
			default:
			}
			<-s.gate.migrated
		}
		s.stop()
	}()
}

// startUp checks what can be refused without changing the database first: a busy port or a
// server without logical decoding must not leave migrations or settings behind. The port is
// only probed here and bound once the process can serve, so that clients and TCP health
// checks are refused, not left hanging in the backlog, while it starts.
func (s *server) startUp() error {
	if err := probeListen(s.cfg.Listen); err != nil {
		return err
	}
	if err := s.serveOps(); err != nil {
		return err
	}
	if err := db.WaitReachable(s.ctx, s.cfg.DatabaseURL, s.cfg.DBWait, s.log); err != nil {
		return err
	}
	if err := checkWalLevel(s.ctx, s.cfg.DatabaseURL, !s.cfg.NoRelay); err != nil {
		return err
	}
	return s.autoMigrate()
}

// serveOps starts the operator listener: /metrics is useful while start-up waits (for
// PostgreSQL, for migrations), and its /readyz says what it waits for.
func (s *server) serveOps() error {
	if s.cfg.MetricsListen == "" {
		return nil
	}
	ln, err := net.Listen("tcp", s.cfg.MetricsListen)
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w (set BUZZ_METRICS_LISTEN to a free address, or empty to turn it off)", s.cfg.MetricsListen, err)
	}
	s.ops = serveOps(ln, &s.opsReady, s.log)
	return nil
}

// autoMigrate runs the migrations when BUZZ_AUTO_MIGRATE asks for them.
func (s *server) autoMigrate() error {
	defer s.gate.end()
	if !s.cfg.AutoMigrate {
		return nil
	}
	hooks.At(s.ctx, hookBeforeMigrations)
	// Migrations take no context and, once begun, run to their end (see watchSecondSignal): a
	// signal that came before them is honoured here, or they would run on a stop the operator
	// asked for.
	if err := s.ctx.Err(); err != nil {
		return err
	}
	close(s.gate.migrating)
	if err := db.MigrateUp(s.cfg.DatabaseURL, s.log); err != nil {
		// A newer schema is served as with auto-migrate off (checkSchema says so): an old
		// binary restarting during a rollout or a rollback must not crash-loop on it.
		var newer *db.SchemaNewerError
		if !errors.As(err, &newer) {
			return err
		}
		s.log.Warn("not migrating: the schema is newer than this binary", "schema_version", newer.Have, "binary_version", newer.Latest)
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
