package fanout

import (
	"fmt"
	"github.com/prometheus/client_golang/prometheus"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// handle decodes one pgoutput message.
func (f *Fanout) handle(s *session, data []byte) error {
	if len(data) > 0 && data[0] == byte(pglogrepl.MessageTypeInsert) {
		// The bulk of the stream: parsed in place (parseInsert), and only if not skipped.
		return f.change(s, func() error { return f.handleInsert(s, data) })
	}
	m, err := pglogrepl.Parse(data)
	if err != nil {
		return fmt.Errorf("pgoutput: %w", err)
	}
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		s.rels[m.RelationID] = newRelation(m)
	case *pglogrepl.BeginMessage:
		f.begin(s, m)
	case *pglogrepl.CommitMessage:
		f.commit(s, m)
	case *pglogrepl.UpdateMessage, *pglogrepl.DeleteMessage, *pglogrepl.TruncateMessage,
		*pglogrepl.LogicalDecodingMessage:
		return f.change(s, func() error { return f.handleChange(s, m) })
	}
	return nil
}

// change hands one change over with handle, unless it was handed over before.
func (f *Fanout) change(s *session, handle func() error) error {
	if !s.inTxn {
		return handle() // a non-transactional message, placed by its own LSN
	}
	// Every change counts, whatever becomes of it, so positions match on a resend; Relation
	// and Type messages do not, as a new session sends them again before first use.
	if s.skipTxn || f.handedBefore(s) {
		return nil
	}
	if err := handle(); err != nil {
		return err
	}
	f.handedChange(s)
	return nil
}

// begin starts a transaction: skipped whole when we handed it over already.
func (f *Fanout) begin(s *session, m *pglogrepl.BeginMessage) {
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
}

// commit ends a transaction: our position moves past it once all of it reached the sink.
func (f *Fanout) commit(s *session, m *pglogrepl.CommitMessage) {
	s.inTxn = false
	f.handing.Store(0)
	if !s.skipTxn {
		f.inflight = txnProgress{}
		f.lastEnd = m.TransactionEndLSN
		f.lagNanos.Store(int64(time.Since(m.CommitTime)))
		f.lastCommit.Store(m.CommitTime.UnixNano())
	}
	s.skipTxn = false
}

// handleInsert hands a buzz.events row to the sink.
func (f *Fanout) handleInsert(s *session, data []byte) error {
	relID, cols, err := parseInsert(data, s.cols)
	s.cols = cols
	if err != nil {
		return err
	}
	r := s.rels[relID]
	if r == nil {
		return fmt.Errorf("pgoutput: insert into unknown relation %d", relID)
	}
	if r.schema != "buzz" || r.table != "events" {
		return nil // the publication may grow; we only fan out events
	}
	d, err := decodeRow(r, cols)
	if err != nil {
		// One undecodable row must not stop fan-out for everyone: log it and go on.
		f.log.Error("fan-out cannot decode an events row; skipped", "err", err)
		return nil
	}
	d.Xid, d.CommitLSN = s.xid, uint64(s.finalLSN)
	f.deliverEvent(d, s.finalLSN)
	return nil
}

// handleChange hands a logical message to the sink (updates, deletes and truncates are not
// fanned out).
func (f *Fanout) handleChange(s *session, m pglogrepl.Message) error {
	switch m := m.(type) {
	case *pglogrepl.LogicalDecodingMessage:
		f.handleMessage(s, m)
	}
	return nil
}

// handleMessage hands what a 'buzz' logical message carries to the sink.
func (f *Fanout) handleMessage(s *session, m *pglogrepl.LogicalDecodingMessage) {
	if m.Prefix != MessagePrefix {
		return
	}
	if !m.Transactional && m.LSN < f.lastEnd {
		return
	}
	c, ok, err := decodeMessage(m.Content)
	if err != nil {
		f.rejected(rejectMalformed, "err", err)
		return
	}
	if !ok {
		return
	}
	at, xid, commitLSN := m.LSN, uint32(0), uint64(0)
	if m.Transactional {
		at, xid, commitLSN = s.finalLSN, s.xid, uint64(s.finalLSN)
	}
	if c.members != nil {
		c.members.Xid = xid
		f.sink.MembersChanged(*c.members) // idempotent: no de-dup, and not a delivered event
	}
	for _, d := range c.events {
		if why := rejection(d.Event); why != "" {
			f.rejected(why, "id", d.Event.ID, "pubkey", d.Event.PubKey, "kind", d.Event.Kind)
			continue
		}
		d.Xid, d.CommitLSN = xid, commitLSN
		f.deliverEvent(d, at)
	}
	for _, d := range c.dues {
		if why := rejection(d.Event); why != "" {
			f.rejected(why, "id", d.Event.ID, "pubkey", d.Event.PubKey, "stamp", d.Stamp)
			continue
		}
		d.CommitLSN = commitLSN
		f.deliverDue(d, at)
	}
}

// rejected counts a message, or an event in one, that is not delivered (verify.go), and logs it:
// one line per 10 s, with the count of those folded, as a flood of forged messages must not
// flood the log as well.
func (f *Fanout) rejected(reason string, args ...any) {
	metrics.FanoutRejected.WithLabelValues(reason).Inc()
	if log, folded := f.rejectLog.Allow(time.Now()); log {
		f.log.Error("fan-out ignored a buzz logical message it cannot trust (does a role that should not emit them have EXECUTE on pg_logical_emit_message?)",
			append([]any{"reason", reason, "similar_since_last", folded}, args...)...)
	}
}

// deliverEvent hands d to the sink unless this exact delivery was handed over already: the same
// transaction (at) resent after a break or a PostgreSQL restart. The same id in another
// transaction is a new delivery (an event deleted and stored again).
func (f *Fanout) deliverEvent(d evt.Delivery, at pglogrepl.LSN) {
	if !f.firstTime(at, d.Event.ID) {
		return
	}
	f.sink.DeliverEvent(d)
	source := deliveredInsert
	if d.Event.Kind >= 20000 && d.Event.Kind < 30000 {
		source = deliveredEphemeral
	}
	f.delivered(source)
}

// deliverDue is deliverEvent for a due signal, told apart by its stamp as well (dueKey).
func (f *Fanout) deliverDue(d evt.Due, at pglogrepl.LSN) {
	if !f.firstTime(at, dueKey(d)) {
		return
	}
	f.sink.DeliverDue(d)
	f.delivered(deliveredDue)
}

// firstTime reports whether the delivery key of transaction at was not handed over before.
func (f *Fanout) firstTime(at pglogrepl.LSN, key string) bool {
	if !f.seen.add(deliveryKey{uint64(at), key}) {
		f.skippedDup.Add(1)
		return false
	}
	return true
}

// The delivered counters by source, looked up once rather than per event.
var (
	deliveredInsert    = metrics.FanoutDelivered.WithLabelValues("insert")
	deliveredEphemeral = metrics.FanoutDelivered.WithLabelValues("ephemeral")
	deliveredDue       = metrics.FanoutDelivered.WithLabelValues("due")
)

// delivered counts a hand-off in source's counter (/metrics).
func (f *Fanout) delivered(source prometheus.Counter) {
	f.deliveredN.Add(1)
	source.Inc()
}
