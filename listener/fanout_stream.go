package listener

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// fanPluginArgs: pgoutput protocol 1 (PG 15), our publication, and logical messages (ephemeral
// events and reminder due signals are not rows).
var fanPluginArgs = []string{"proto_version '1'", "publication_names 'buzz_events'", "messages 'true'"}

// session is the per-connection decoding state.
type replSession struct {
	rels       map[uint32]*pgRelation
	inTxn      bool
	skipTxn    bool // this transaction ended at or before lastEnd: already handed over
	commitTime time.Time
	finalLSN   pglogrepl.LSN // of the transaction being decoded: with the id, the de-dup key
	xid        uint32        // of the transaction being decoded
	pos        int           // changes of that transaction received in this session
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
		pglogrepl.StartReplicationOptions{PluginArgs: fanPluginArgs}); err != nil {
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

	s := &replSession{rels: map[uint32]*pgRelation{}}
	nextStatus := time.Now().Add(f.cfg.StatusInterval)
	for {
		if !time.Now().Before(nextStatus) {
			// Acknowledge only what the sink already has: lastEnd moves after hand-off.
			if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn,
				pglogrepl.StandbyStatusUpdate{WALWritePosition: f.lastEnd}); err != nil {
				return true, fmt.Errorf("standby status update: %w", err)
			}
			nextStatus = time.Now().Add(f.cfg.StatusInterval)
		}
		rctx, cancel := context.WithDeadline(ctx, nextStatus)
		raw, err := conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if pgconn.Timeout(err) && ctx.Err() == nil {
				continue // time to send a status update
			}
			return true, err
		}
		switch msg := raw.(type) {
		case *pgproto3.CopyData:
			if len(msg.Data) == 0 {
				continue
			}
			switch msg.Data[0] {
			case pglogrepl.PrimaryKeepaliveMessageByteID:
				k, err := pglogrepl.ParsePrimaryKeepaliveMessage(msg.Data[1:])
				if err != nil {
					return true, err
				}
				// Between transactions, everything before the server's position has been sent and
				// handled (including transactions pgoutput skipped as empty), so the slot may move
				// there; otherwise WAL written by other tables would stay pinned.
				if !s.inTxn && k.ServerWALEnd > f.lastEnd {
					f.lastEnd = k.ServerWALEnd
				}
				if k.ReplyRequested {
					nextStatus = time.Time{}
				}
			case pglogrepl.XLogDataByteID:
				x, err := pglogrepl.ParseXLogData(msg.Data[1:])
				if err != nil {
					return true, err
				}
				if err := f.handle(s, x.WALData); err != nil {
					return true, err
				}
			}
		case *pgproto3.ErrorResponse:
			return true, pgconn.ErrorResponseToPgError(msg)
		case *pgproto3.CopyDone:
			return true, fmt.Errorf("server ended the replication stream")
		}
	}
}

// handle decodes one pgoutput message.
func (f *Fanout) handle(s *replSession, data []byte) error {
	m, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("pgoutput: %w", err)
	}
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		s.rels[m.RelationID] = newPgRelation(m)
	case *pglogrepl.BeginMessage:
		s.inTxn = true
		s.commitTime = m.CommitTime
		s.finalLSN = m.FinalLSN
		s.xid = m.Xid
		f.handing.Store(m.CommitTime.UnixNano())
		// FinalLSN is where the commit record starts; a transaction we handled ended (its
		// TransactionEndLSN, our lastEnd) after that point.
		s.skipTxn = m.FinalLSN < f.lastEnd
		if s.skipTxn {
			f.skippedTxn.Add(1)
		} else {
			f.beginTxn(s, m)
		}
	case *pglogrepl.CommitMessage:
		s.inTxn = false
		f.handing.Store(0)
		if !s.skipTxn {
			f.inflight = txnProgress{}
			f.lastEnd = m.TransactionEndLSN
			now := time.Now()
			f.lagNanos.Store(int64(now.Sub(m.CommitTime)))
			f.lastCommit.Store(m.CommitTime.UnixNano())
		}
		s.skipTxn = false
	case *pglogrepl.InsertMessage, *pglogrepl.UpdateMessage, *pglogrepl.DeleteMessage,
		*pglogrepl.TruncateMessage, *pglogrepl.LogicalDecodingMessage:
		if !s.inTxn {
			return f.handleChange(s, m) // a non-transactional message, placed by its own LSN
		}
		// Every change counts, whatever becomes of it, so positions match on a resend; Relation
		// and Type messages do not, as a new session sends them again before first use.
		if s.skipTxn || f.handedBefore(s) {
			return nil
		}
		if err := f.handleChange(s, m); err != nil {
			return err
		}
		f.handedChange(s)
	}
	return nil
}

// handleChange hands a row or a logical message to the sink.
func (f *Fanout) handleChange(s *replSession, m pglogrepl.Message) error {
	switch m := m.(type) {
	case *pglogrepl.InsertMessage:
		r := s.rels[m.RelationID]
		if r == nil {
			return fmt.Errorf("pgoutput: insert into unknown relation %d", m.RelationID)
		}
		if r.schema != "buzz" || r.table != "events" {
			return nil // the publication may grow; we only fan out events
		}
		d, err := fanDecodeRow(r, m.Tuple)
		if err != nil {
			// One undecodable row must not stop fan-out for everyone: log it and go on.
			f.log.Error("fan-out cannot decode an events row; skipped", "err", err)
			return nil
		}
		d.Xid, d.CommitLSN = s.xid, uint64(s.finalLSN)
		f.deliver(d, s.finalLSN)
	case *pglogrepl.LogicalDecodingMessage:
		if m.Prefix != MessagePrefix {
			return nil
		}
		if !m.Transactional && m.LSN < f.lastEnd {
			return nil
		}
		ds, ok, err := fanDecodeMessage(m.Content)
		if err != nil {
			f.log.Error("fan-out cannot decode a buzz message; skipped", "err", err)
			return nil
		}
		if ok {
			at, xid := m.LSN, uint32(0)
			if m.Transactional {
				at, xid = s.finalLSN, s.xid
			}
			for _, d := range ds {
				d.Xid = xid
				if m.Transactional {
					d.CommitLSN = uint64(at)
				}
				if d.Members != nil {
					f.sink.Deliver(d) // idempotent: no de-dup, and not a delivered event
					continue
				}
				f.deliver(d, at)
			}
		}
	}
	return nil
}

// deliver hands d to the sink unless this exact delivery was handed over already: the same
// transaction (at) resent after a break or a PostgreSQL restart. The same id in another
// transaction is a new delivery (an event deleted and stored again).
func (f *Fanout) deliver(d evt.Delivery, at pglogrepl.LSN) {
	if !f.seen.add(at.String() + "/" + fanDedupeKey(d)) {
		f.skippedDup.Add(1)
		return
	}
	f.sink.Deliver(d)
	f.delivered.Add(1)
	metrics.FanoutDelivered.WithLabelValues(deliverySource(d)).Inc()
}

// deliverySource labels a delivery for /metrics.
func deliverySource(d evt.Delivery) string {
	switch {
	case d.Due:
		return "due"
	case d.Event.Kind >= 20000 && d.Event.Kind < 30000:
		return "ephemeral"
	}
	return "insert"
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
		f.sink.Deliver(evt.Delivery{Members: &evt.MembersChange{All: true}, Reset: true})
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
