package fanout

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// SlotPrefix starts every replication slot buzzpg owns. Reapers only ever touch slots with this
// prefix (in their own database), so the prefix is reserved for buzzpg.
const SlotPrefix = "buzz_"

var slotUnsafe = regexp.MustCompile(`[^a-z0-9_]`)

// SlotName is the replication slot of an instance: buzz_<instance id>, lowercased, anything outside
// [a-z0-9_] replaced by '_', at most 63 bytes (PostgreSQL's NAMEDATALEN-1; longer names would be
// truncated by the server and no longer match what we look up). When that changed the id, 8 hex
// digits of a hash of the whole id end the name, so ids that differ only in case, punctuation or
// past the cut ("Relay-1" and "relay_1", two long pod names) never share a slot.
func SlotName(instanceID string) string {
	clean := slotUnsafe.ReplaceAllString(strings.ToLower(instanceID), "_")
	s := SlotPrefix + clean
	if clean == instanceID && len(s) <= 63 {
		return s
	}
	h := fnv.New32a()
	h.Write([]byte(instanceID))
	suffix := fmt.Sprintf("_%08x", h.Sum32())
	if len(s) > 63-len(suffix) {
		s = s[:63-len(suffix)]
	}
	return s + suffix
}

// ApplicationName is the application_name of an instance's replication connection, so an operator
// (or a test) can find its walsender in pg_stat_activity / pg_stat_replication.
func ApplicationName(instanceID string) string {
	s := "buzzpg-fanout:" + instanceID
	if len(s) > 63 {
		s = s[:63]
	}
	return s
}

// WalLevelError says the server cannot do logical decoding.
type WalLevelError struct{ Level string }

func (e *WalLevelError) Error() string {
	return fmt.Sprintf("wal_level is %s; buzzpg needs wal_level=logical: ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL", e.Level)
}

// CheckWalLevel fails with a *WalLevelError unless the server runs with wal_level=logical.
func CheckWalLevel(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) error {
	var level string
	if err := q.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		return fmt.Errorf("checking wal_level: %w", err)
	}
	if level != "logical" {
		return &WalLevelError{Level: level}
	}
	return nil
}

// SlotElsewhereError: this instance's slot name is taken by a slot of another database of the
// cluster (slot names are cluster-wide). Retrying cannot help: the instance id must change.
type SlotElsewhereError struct{ Slot, Database, Ours string }

func (e *SlotElsewhereError) Error() string {
	return fmt.Sprintf("replication slot %s belongs to database %q, not %q: instance ids must be unique per PostgreSQL cluster (set another BUZZ_INSTANCE_ID)", e.Slot, e.Database, e.Ours)
}

// slotExists reports whether slot exists and whether the server invalidated it (wal_status
// 'lost'), and fails when a slot of that name belongs to another database (slot names are
// cluster-wide; instance ids must be unique per cluster).
func slotExists(ctx context.Context, pool *pgxpool.Pool, slot string) (exists, lost bool, err error) {
	var db, cur, walStatus string
	err = pool.QueryRow(ctx,
		`SELECT coalesce(database::text, ''), current_database(), coalesce(wal_status, '')
		   FROM pg_replication_slots WHERE slot_name = $1`,
		slot).Scan(&db, &cur, &walStatus)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, false, nil
	}
	if err != nil {
		return false, false, err
	}
	if db != cur {
		return false, false, &SlotElsewhereError{Slot: slot, Database: db, Ours: cur}
	}
	return true, walStatus == "lost", nil
}

// createSlot creates a logical pgoutput slot under a server-side statement_timeout.
//
// Why a timeout: creating a logical slot waits until every transaction that holds an xid and was
// running when the creation began has ended. One forgotten open transaction (psql left in BEGIN,
// a stuck prepared transaction) would otherwise hang start-up silently. On timeout we log the
// sessions that are old enough to be the cause, and the caller retries with backoff. The timeout
// is enforced by the server (statement_timeout), so the half-created (ephemeral) slot is dropped
// by PostgreSQL itself instead of lingering behind a client that went away.
func createSlot(ctx context.Context, pool *pgxpool.Pool, slot string, timeout time.Duration, log *slog.Logger) (created bool, err error) {
	attempt := time.Now()
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, fmt.Sprintf("%dms", timeout.Milliseconds())); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42710" {
		// duplicate_object: a concurrent start of this instance won, or a slot of the same name
		// was made in another database meanwhile (slot names are cluster-wide): look.
		// Not created by us, either way.
		_, _, err := slotExists(ctx, pool, slot)
		return false, err
	}
	if errors.As(err, &pgErr) && pgErr.Code == "57014" { // query_canceled: our statement_timeout
		logSlotBlockers(pool, slot, attempt, timeout, log)
		return false, fmt.Errorf("creating replication slot %s timed out after %s (see the blocking sessions logged above)", slot, timeout)
	}
	if err != nil {
		return false, fmt.Errorf("creating replication slot %s: %w", slot, err)
	}
	return true, nil
}

// logSlotBlockers logs sessions and prepared transactions that hold an xid since before the slot
// creation attempt began: those are what logical slot creation waits for.
func logSlotBlockers(pool *pgxpool.Pool, slot string, attempt time.Time, timeout time.Duration, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := pool.Query(ctx, `
		SELECT pid, coalesce(usename::text,''), coalesce(application_name,''), coalesce(state,''),
		       xact_start, left(coalesce(query,''), 200)
		  FROM pg_stat_activity
		 WHERE backend_xid IS NOT NULL AND xact_start < $1 AND pid <> pg_backend_pid()
		 UNION ALL
		SELECT NULL, owner::text, 'prepared transaction ' || gid, 'prepared', prepared, ''
		  FROM pg_prepared_xacts WHERE prepared < $1
		 ORDER BY 5`, attempt)
	if err != nil {
		log.Error("replication slot creation timed out; listing blockers failed", "slot", slot, "timeout", timeout, "err", err)
		return
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var pid *int32
		var user, app, state, query string
		var xactStart time.Time
		if err := rows.Scan(&pid, &user, &app, &state, &xactStart, &query); err != nil {
			break
		}
		n++
		var pidv any = "none (prepared transaction)"
		if pid != nil {
			pidv = *pid
		}
		log.Error("replication slot creation is blocked by an open transaction; end it (pg_terminate_backend(pid)) or let it finish",
			"slot", slot, "pid", pidv, "user", user, "application_name", app, "state", state,
			"xact_start", xactStart, "query", query)
	}
	if n == 0 {
		log.Error("replication slot creation timed out; no transaction older than the attempt found (it may have ended meanwhile)", "slot", slot, "timeout", timeout)
	}
}

// dropSlot drops slot, waiting (until ctx ends) for its walsender to let go of it: after we close
// the replication connection the server needs a moment to notice.
func dropSlot(ctx context.Context, pool *pgxpool.Pool, slot string) error {
	inUse := false
	for {
		_, err := pool.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
		                           WHERE slot_name = $1 AND database = current_database()`, slot)
		var pgErr *pgconn.PgError
		if err == nil || (errors.As(err, &pgErr) && pgErr.Code == "42704") { // undefined_object: already gone
			return nil
		}
		if inUse && ctx.Err() != nil {
			// The time ran out during a retry: what stopped the drop is still the walsender
			// holding the slot, not the retry (whose error would only say "timeout").
			return fmt.Errorf("dropping replication slot %s: %w (still in use)", slot, ctx.Err())
		}
		if !(errors.As(err, &pgErr) && pgErr.Code == "55006") { // object_in_use: still active
			return err
		}
		inUse = true
		select {
		case <-ctx.Done():
			return fmt.Errorf("dropping replication slot %s: %w (still in use)", slot, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
