package relay

import (
	"bytes"
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// storedRow is one row of an initial answer, as its EVENT message.
type storedRow struct {
	key  idKey
	msg  []byte // `["EVENT","<sub>",<event JSON>]`
	size int    // the event JSON's bytes in msg: what the budgets hold for it
}

// queryStored reads the initial rows of filters, newest first, de-duplicated across filters, and
// the snapshot they were read in. held is what the rows took from the process-wide budget; the
// caller gives it back once they are sent.
func (c *conn) queryStored(ctx context.Context, filters []*compiledFilter, prefix []byte) (out []storedRow, held int64, snap *mvccSnapshot, err error) {
	sql, args := reqSQL(filters, c.authedList())
	if sql == "" {
		return nil, 0, nil, nil
	}
	ans := initialAnswer{rows: make([]storedRow, 0, answerRows(filters))}
	defer func() {
		if p := recover(); p != nil {
			c.releaseInitial(ans.held) // recoverQuery answers the client; the bytes must come back
			panic(p)
		}
		if err != nil {
			c.releaseInitial(ans.held)
			out, held, snap = nil, 0, nil
		}
	}()
	err = c.runQuery(ctx, "REQ", func(ctx context.Context, pc *pgxpool.Conn) error {
		var rerr error
		snap, rerr = c.readInSnapshot(ctx, pc, sql, args, prefix, &ans)
		return rerr
	})
	if err != nil {
		return nil, 0, nil, err
	}
	return ans.rows, ans.held, snap, nil
}

// answerRows is about how many rows an answer to filters holds: its slice is allocated once.
func answerRows(filters []*compiledFilter) int {
	n := 0
	for _, cf := range filters {
		if !cf.none {
			n += max(cf.limit, 0)
		}
	}
	return min(n, 512)
}

// initialAnswer is an initial answer as it is read: its rows so far and the bytes they took from
// the budgets (takeInitial), which queryStored gives back if the answer fails.
type initialAnswer struct {
	rows []storedRow
	held int64
}

// readInSnapshot reads the rows of the query sql into ans, and the snapshot they were read in:
// both come from one transaction, so from one snapshot, and all four statements go in one round
// trip.
func (c *conn) readInSnapshot(ctx context.Context, pc *pgxpool.Conn, sql string, args []any, prefix []byte, ans *initialAnswer) (snap *mvccSnapshot, err error) {
	b := &pgx.Batch{}
	b.Queue(`BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY`)
	b.Queue(`SELECT pg_current_snapshot()::text, pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`)
	b.Queue(sql, args...)
	b.Queue(`COMMIT`)
	br := pc.SendBatch(ctx, b)
	defer func() {
		if cerr := br.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			abandonTx(pc)
		}
	}()
	if _, err = br.Exec(); err != nil {
		return nil, err
	}
	if snap, err = scanSnapshot(br); err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	if err = c.readRows(rows, prefix, ans); err != nil {
		return nil, err
	}
	rows.Close()
	if err = rows.Err(); err != nil {
		return nil, err
	}
	if _, err = br.Exec(); err != nil { // COMMIT
		return nil, err
	}
	return snap, nil
}

// scanSnapshot reads the transaction's snapshot and the WAL position it was taken at.
func scanSnapshot(br pgx.BatchResults) (*mvccSnapshot, error) {
	var snapText string
	var walPos int64
	if err := br.QueryRow().Scan(&snapText, &walPos); err != nil {
		return nil, err
	}
	snap, err := parseMVCCSnapshot(snapText)
	if err != nil {
		return nil, err
	}
	snap.walPos = uint64(walPos)
	return snap, nil
}

// readRows appends the query's rows to ans as EVENT messages with prefix, one per event, until
// maxInitialBytes or a budget (takeInitial) stops them. errBudgetSpent: not even the first row
// fit.
func (c *conn) readRows(rows pgx.Rows, prefix []byte, ans *initialAnswer) error {
	fds := rows.FieldDescriptions()
	total := 0
	var prev []byte
	for rows.Next() {
		vals := rows.RawValues() // valid until Next: what is kept is copied (rowFrame, prev)
		if len(vals) > colID && prev != nil && bytes.Equal(vals[colID], prev) {
			continue // the same row matched by another filter: adjacent in (created_at, id) order
		}
		msg, size, err := rowFrame(getFrame(rowFrameSize(prefix, vals)), prefix, vals, fds)
		if err != nil {
			return err
		}
		prev = append(prev[:0], vals[colID]...)
		total += size
		if total > maxInitialBytes {
			metrics.InitialTruncated.WithLabelValues("query").Inc()
			c.log.Debug("initial query truncated", "bytes", maxInitialBytes, "rows", len(ans.rows))
			return nil
		}
		if bound := c.takeInitial(int64(size)); bound != "" {
			// Every connection's answers together stay within the budget, and one connection's
			// (one client IP's) within its share: this one gets the newest rows that fit (NIP-01
			// lets a relay return fewer than limit), or, when not one fits, a CLOSED that says why.
			metrics.InitialTruncated.WithLabelValues(bound).Inc()
			c.log.Debug("initial query truncated", "bound", bound, "rows", len(ans.rows))
			if len(ans.rows) == 0 {
				return errBudgetSpent
			}
			return nil
		}
		ans.held += int64(size)
		ans.rows = append(ans.rows, storedRow{key: keyOfBytes(vals[colID]), msg: msg, size: size})
	}
	return nil
}
