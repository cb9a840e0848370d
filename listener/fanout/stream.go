package fanout

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// pluginArgs: pgoutput protocol 1 (PG 15), our publication, and logical messages (ephemeral
// events and reminder due signals are not rows).
var pluginArgs = []string{"proto_version '1'", "publication_names 'buzz_events'", "messages 'true'"}

// session is the per-connection decoding state.
type session struct {
	rels       map[uint32]*relation
	inTxn      bool
	skipTxn    bool // this transaction ended at or before lastEnd: already handed over
	commitTime time.Time
	finalLSN   pglogrepl.LSN // of the transaction being decoded: with the id, the de-dup key
	xid        uint32        // of the transaction being decoded
	pos        int           // changes of that transaction received in this session
	cols       []column      // parseInsert's scratch
}

// stream runs one replication session: make sure the slot exists, attach, and hand everything to
// the sink until an error. attached says whether START_REPLICATION succeeded (a session that then
// lasted stableSession resets the backoff).
func (f *Fanout) stream(ctx context.Context) (attached bool, err error) {
	if err := f.ensureSlot(ctx); err != nil {
		return false, err
	}
	conn, err := f.connect(ctx)
	if err != nil {
		return false, err
	}
	defer conn.Close(context.Background())

	// Ask for what follows our own last hand-off. The server starts at the later of this and the
	// slot's confirmed position; after a crash PostgreSQL 15 may resend from an older point anyway,
	// which the LSN and id checks below absorb.
	start := f.lastEnd
	if f.startHook != nil {
		start = f.startHook(start)
	}
	if err := pglogrepl.StartReplication(ctx, conn, f.slot, start,
		pglogrepl.StartReplicationOptions{PluginArgs: pluginArgs}); err != nil {
		return false, fmt.Errorf("START_REPLICATION: %w", err)
	}
	f.ready.Store(true)
	f.owns.Store(true)
	f.attachedAt = time.Now()
	if f.attachedHook != nil {
		f.attachedHook()
	}
	defer f.ready.Store(false)
	// A break inside a transaction leaves it half handed over; if it is never resent (a new
	// slot), Lag must not keep counting from its commit time.
	defer f.handing.Store(0)
	f.sessions.Add(1)
	f.log.Info("fan-out replication stream attached", "start_lsn", start.String())

	// Reads wait on the socket's deadline, not a context per message: a context with a deadline
	// costs a timer and a watcher per message, about a fifth of this loop's CPU under load. One
	// watcher per session ends the wait when ctx ends.
	netConn := conn.Conn()
	defer netConn.SetReadDeadline(time.Time{}) //nolint:errcheck // after the watcher has stopped
	defer context.AfterFunc(ctx, func() { _ = netConn.SetReadDeadline(time.Now()) })()

	s := &session{rels: map[uint32]*relation{}}
	nextStatus := time.Now().Add(f.cfg.StatusInterval)
	deadline := time.Time{} // the socket's read deadline, once set
	for {
		if !time.Now().Before(nextStatus) {
			// Acknowledge only what the sink already has: lastEnd moves after hand-off.
			if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn,
				pglogrepl.StandbyStatusUpdate{WALWritePosition: f.lastEnd}); err != nil {
				return true, fmt.Errorf("standby status update: %w", err)
			}
			nextStatus = time.Now().Add(f.cfg.StatusInterval)
		}
		if !deadline.Equal(nextStatus) {
			deadline = nextStatus
			_ = netConn.SetReadDeadline(deadline)
			if ctx.Err() != nil { // ended before this deadline was set, which replaced the watcher's
				return true, ctx.Err()
			}
		}
		raw, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			if pgconn.Timeout(err) && ctx.Err() == nil {
				continue // time to send a status update
			}
			return true, err
		}
		replyNow, err := f.receive(s, raw)
		if err != nil {
			return true, err
		}
		if replyNow {
			nextStatus = time.Time{}
		}
	}
}

// receive handles one message of the replication stream; replyNow says the server asked for a
// status update.
func (f *Fanout) receive(s *session, raw pgproto3.BackendMessage) (replyNow bool, err error) {
	switch msg := raw.(type) {
	case *pgproto3.CopyData:
		if len(msg.Data) == 0 {
			return false, nil
		}
		switch msg.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			k, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
			if err != nil {
				return false, err
			}
			// Between transactions, everything before the server's position has been sent and
			// handled (including transactions pgoutput skipped as empty), so the slot may move
			// there; otherwise WAL written by other tables would stay pinned.
			if !s.inTxn && k.ServerWALEnd > f.lastEnd {
				f.lastEnd = k.ServerWALEnd
			}
			return k.ReplyRequested, nil
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(msg.Data[1:])
			if err != nil {
				return false, err
			}
			return false, f.handle(s, x.WALData)
		}
	case *pgproto3.ErrorResponse:
		return false, pgconn.ErrorResponseToPgError(msg)
	case *pgproto3.CopyDone:
		return false, fmt.Errorf("server ended the replication stream")
	}
	return false, nil
}

// ensureSlot creates this instance's slot when it is missing: on first start, and when a reaper
// dropped it while we were silent (then whatever was committed meanwhile is lost for our
// subscribers, so we say so).
func (f *Fanout) ensureSlot(ctx context.Context) error {
	ok, invalid, err := slotExists(ctx, f.pool, f.slot)
	if err != nil {
		return err
	}
	if ok && invalid {
		// The server invalidated the slot (it retained more than max_slot_wal_keep_size): it can
		// never stream again. Recreate it; the gap is lost for this process's subscribers.
		f.log.Error("fan-out replication slot was invalidated by max_slot_wal_keep_size (this process fell too far behind); recreating it: events in the gap are not delivered by this process")
		if err := dropSlot(ctx, f.pool, f.slot); err != nil {
			return err
		}
		ok = false
	}
	if ok {
		f.hadSlot = true
		f.slotOnce.Do(func() { close(f.slotMade) })
		return nil
	}
	lost := f.hadSlot
	if lost {
		f.log.Error("fan-out replication slot vanished (reaped as stale, or dropped by hand); recreating it: events committed while it was missing are not delivered by this process")
	}
	// Our position belonged to the old slot. After a failover to a standby or a restore, WAL
	// positions start below it again, and keeping it would skip (and ask the server to skip)
	// every transaction up to it. Forgotten before the creation, which may succeed even when its
	// statement reports an error. The id window still drops a recent delivery handed over twice.
	f.lastEnd = 0
	// A transaction broken off on the old slot is not resent on the new one, and after a failover
	// its commit LSN and xid may name another transaction there.
	f.inflight = txnProgress{}
	// Register before creating: a slot without an instance row counts as orphaned for reapers.
	if err := f.beat(ctx); err != nil {
		return err
	}
	created, err := createSlot(ctx, f.pool, f.slot, f.cfg.SlotCreateTimeout, f.log)
	if err != nil {
		return err
	}
	f.hadSlot = true
	f.slotOnce.Do(func() { close(f.slotMade) })
	if created {
		f.owns.Store(true)
		f.slotsMade.Add(1)
		f.log.Info("fan-out replication slot created")
	} else {
		// 42710: another start with this instance id made it meanwhile; not ours to drop.
		f.log.Warn("fan-out replication slot was created by another process meanwhile (is another process running with this BUZZ_INSTANCE_ID?)")
	}
	if lost {
		// A member edit announced while the slot was missing never reaches us, and a cached set
		// is only dropped when one does: forget them all before the first event of the new slot.
		f.sink.StreamRestarted()
	}
	return nil
}

// connect opens the replication connection (replication=database) with our application_name.
func (f *Fanout) connect(ctx context.Context) (*pgconn.PgConn, error) {
	cfg, err := pgconn.ParseConfig(f.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("fanout: DATABASE_URL: %w", err)
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = ApplicationName(f.cfg.InstanceID)
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = 10 * time.Second
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("replication connection: %w", err)
	}
	return conn, nil
}
