package fanout

import "github.com/jackc/pglogrepl"

// txnProgress is how far the transaction being handed over got. With protocol 1 (no streaming of
// transactions in progress) a transaction reaches us whole, after its commit, but our position
// moves only at its Commit message: when the session breaks in the middle of one (a killed
// walsender, the network, a PostgreSQL restart), the next session sends all of it again. Decoding
// the same WAL yields the same changes in the same order, and BEGIN names the transaction by its
// commit LSN and xid, so the changes handed over before the break are exactly the first `handed`
// ones of the resend. A count holds for a transaction of any size (an import, a large reminder
// batch); the id window does not (see recentKeys).
//
// It lives in memory only, on purpose: a new process (after a crash of this one) has connections
// that never saw the transaction, and it must hand over all of it.
type txnProgress struct {
	finalLSN pglogrepl.LSN // commit LSN from BEGIN; 0 between transactions
	xid      uint32
	handed   int // changes (rows and logical messages, delivered or filtered out) handed over
}

// beginTxn starts counting the changes of the transaction BEGIN announced, or, when it is the one a
// broken session was handing over, keeps the count so its first changes are skipped.
func (f *Fanout) beginTxn(s *session, m *pglogrepl.BeginMessage) {
	s.pos = 0
	p := f.inflight
	if p.handed > 0 && p.finalLSN == m.FinalLSN && p.xid == m.Xid {
		f.log.Info("fan-out resumes a transaction the stream broke off; skipping the changes already handed over",
			"final_lsn", m.FinalLSN.String(), "xid", m.Xid, "handed", p.handed)
		return
	}
	if p.handed > 0 {
		// Nothing can commit between our position and the broken-off transaction, so the server
		// must send it first; if it does not, it is never sent again (a new slot) and the id window
		// is all that is left against duplicates.
		f.log.Warn("fan-out did not get the transaction the stream broke off back first",
			"final_lsn", p.finalLSN.String(), "xid", p.xid, "handed", p.handed, "got_final_lsn", m.FinalLSN.String(), "got_xid", m.Xid)
	}
	f.inflight = txnProgress{finalLSN: m.FinalLSN, xid: m.Xid}
}

// handedBefore reports whether the next change of the current transaction was handed over before
// the stream broke (then it is skipped).
func (f *Fanout) handedBefore(s *session) bool {
	s.pos++
	if s.pos <= f.inflight.handed {
		f.skippedResent.Add(1)
		return true
	}
	return false
}

// handedChange records that the current change reached the sink.
func (f *Fanout) handedChange(s *session) { f.inflight.handed = s.pos }
