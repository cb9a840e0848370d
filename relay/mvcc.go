package relay

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// mvccSnapshot is a PostgreSQL MVCC snapshot (xmin, xmax, the ids in progress): which
// transactions one query saw, pg_current_snapshot() read in the query's own transaction. An event
// whose transaction the snapshot saw was answered by the query or passed over (by limit, or
// because it was already replaced or deleted): it is not delivered live to that subscription. One
// whose transaction it did not see is new to it. Exact, unlike a window of remembered ids, however
// far behind the replication stream is. (Not the NIP-DV visibility snapshot, a kind 30622 event.)
type mvccSnapshot struct {
	xmin, xmax uint64
	xip        []uint64 // in progress at the snapshot, sorted
	// walPos is the WAL insert position read right after the snapshot was taken: every
	// transaction the snapshot saw committed before it.
	walPos uint64
}

// parseMVCCSnapshot reads pg_snapshot's text form, "xmin:xmax:xip,xip,...".
func parseMVCCSnapshot(s string) (*mvccSnapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return nil, fmt.Errorf("snapshot %q: want xmin:xmax:xip", s)
	}
	var snap mvccSnapshot
	var err error
	if snap.xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return nil, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if snap.xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return nil, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("snapshot %q: %w", s, err)
			}
			snap.xip = append(snap.xip, v)
		}
		slices.Sort(snap.xip)
	}
	return &snap, nil
}

// sees reports whether the snapshot saw the committed transaction whose id has these low 32
// bits (logical decoding gives no epoch).
func (s *mvccSnapshot) sees(xid uint32) bool { return s.seesFull(s.place(xid)) }

// place returns the full transaction id with these low 32 bits nearest xmax (below 0 for one
// before the first epoch, which every snapshot saw). A transaction being delivered is recent,
// within 2^31 of any snapshot taken while it is in flight: PostgreSQL stops assigning ids before
// the newest is 2^31 past the oldest one still running.
func (s *mvccSnapshot) place(xid uint32) int64 {
	return int64(s.xmax) + int64(int32(xid-uint32(s.xmax)))
}

// seesFull reports whether the snapshot saw the committed transaction with this full id.
func (s *mvccSnapshot) seesFull(full int64) bool {
	switch {
	case full < int64(s.xmin):
		return true
	case full >= int64(s.xmax):
		return false
	}
	_, running := slices.BinarySearch(s.xip, uint64(full))
	return !running
}
