package relay

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

// pendingForget is an announced member edit no lookup's snapshot has seen yet. It is never taken
// as visible by age: a commit stays invisible while its backend waits for a synchronous standby,
// which a stalled or restarting standby can make last any time, and a lookup that read the old
// set then would deliver the DM to a removed member and cache that set until the next edit.
type pendingForget struct {
	xid uint32 // low 32 bits, as logical decoding gives them
	// full is the whole transaction id once a snapshot placed it (0 until then). A placed entry
	// was unseen, so its transaction was in flight: it holds the cluster's xmin back, and
	// PostgreSQL assigns no id 2^31 past it, so the placement is exact; the low bits alone would
	// name a newer transaction once 2^31 more had started.
	full int64
	at   time.Time
}

// unseenWarnAfter: a forget unseen for longer is logged (then at most once per interval): the
// usual gap is a commit's last steps, so this long means a stalled synchronous standby, or a
// session that cannot finish its commit.
const unseenWarnAfter = 10 * time.Second

// begin returns what a lookup checks its read against: the forget epoch (put caches only what
// no forget came after) and the forgets pending now. A lookup whose snapshot is older than
// another's may finish after it, when the other has already removed the entries it saw: this
// one must still see them itself.
func (mc *memberCache) begin() (epoch uint64, pending []pendingForget) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return mc.epoch, append([]pendingForget(nil), mc.pending...)
}

// sawForgets reports whether snap sees the transaction of every forget pending when the lookup
// began (began) or announced since. Entries it sees stop being pending: visibility only grows,
// so every later snapshot sees them too. Unseen ones are placed (full) and stay, without limit
// of time. Their number is bounded by the server's backends: every forget checks them all
// (settle), and each still unseen then is a transaction in flight, holding a backend.
func (mc *memberCache) sawForgets(snap *mvccSnapshot, began []pendingForget) bool {
	now := timeNow()
	var oldest *pendingForget
	unseen := func(p *pendingForget) {
		if oldest == nil || p.at.Before(oldest.at) {
			oldest = p
		}
	}
	mc.mu.Lock()
	for i := range began {
		if !snap.seesFull(placed(snap, began[i])) {
			unseen(&began[i])
		}
	}
	kept := mc.pending[:0]
	for _, p := range mc.pending {
		p.full = placed(snap, p)
		if snap.seesFull(p.full) {
			continue
		}
		kept = append(kept, p)
		unseen(&kept[len(kept)-1])
	}
	clear(mc.pending[len(kept):])
	mc.pending = kept
	n := len(kept)
	var waited time.Duration
	var xid uint32
	if oldest != nil {
		waited, xid = now.Sub(oldest.at), oldest.xid
	}
	mc.mu.Unlock()

	metrics.MemberEditUnseenSeconds.Set(waited.Seconds())
	if waited > unseenWarnAfter {
		if ok, folded := mc.unseenLog.Allow(now); ok && mc.log != nil {
			mc.log.Warn("an announced DM member edit is still not visible to other sessions; member lookups wait for it (a synchronous standby that does not answer?)",
				"xid", xid, "waited", waited.Round(time.Second), "pending", n, "similar_since_last", folded)
		}
	}
	return oldest == nil
}

func placed(snap *mvccSnapshot, p pendingForget) int64 {
	if p.full != 0 {
		return p.full
	}
	return snap.place(p.xid)
}

// settle checks the pending forgets against a fresh snapshot right after a forget: one seen
// then is dropped, one still unseen is placed. Without it, a process that looks up no set for a
// long time would keep every edit's id, unplaced, and after 2^31 more transactions read it as a
// future one and wait for good. Best effort: a failed check leaves them for the next lookup.
func (mc *memberCache) settle(ctx context.Context, pool *pgxpool.Pool) error {
	_, began := mc.begin()
	if len(began) == 0 {
		return nil
	}
	var snapText string
	if err := pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&snapText); err != nil {
		return err
	}
	snap, err := parseMVCCSnapshot(snapText)
	if err != nil {
		return err
	}
	mc.sawForgets(snap, began)
	return nil
}

// dropPending forgets the pending forgets when the replication stream restarts on a new slot.
// Creating a slot waits for every transaction open at the time, so on the same server they are
// all visible by now; on another (after a failover) their ids may name other transactions, or
// none yet, and waiting for those would hold lookups up for nothing.
func (mc *memberCache) dropPending() {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	mc.pending = nil
}
