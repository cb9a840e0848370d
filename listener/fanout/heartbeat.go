package fanout

import (
	"context"
	"math/rand/v2"
	"time"
)

// heartbeat registers this instance, then refreshes its row every cfg.Heartbeat and reaps the
// slots of instances silent for longer than cfg.StaleAfter. It runs beside the replication stream
// on the ordinary pool, so a process whose stream is reconnecting still counts as alive (its slot
// must survive exactly that).
//
// A process reaps only once its own beats have gone through without a long gap for StaleAfter:
// after an outage of the database (a restart, a network cut) every process was silent, and the
// first one back must not take the others, whose beats are seconds away, for dead. A gap shorter
// than max(2 heartbeats, StaleAfter/3) cannot make a live process look stale, so an occasional
// failed beat on a loaded database does not stop reaping.
func (f *Fanout) heartbeatLoop(ctx context.Context) {
	rc := reapClock{gap: max(2*f.cfg.Heartbeat, f.cfg.StaleAfter/3), staleAfter: f.cfg.StaleAfter}
	for {
		if rc.beat(f.beat(ctx), time.Now()) {
			f.reap(ctx)
		}
		// Jitter keeps several processes started together from reaping in lockstep.
		d := f.cfg.Heartbeat + time.Duration(rand.Int64N(int64(f.cfg.Heartbeat)/10+1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

// reapClock decides when a process may reap: once its successful beats have followed each other
// with no gap of `gap` or more for staleAfter.
type reapClock struct {
	gap, staleAfter time.Duration
	upSince, lastOK time.Time // start of the current gap-free run of beats; its last success
}

// beat records one heartbeat's outcome and says whether to reap now. Only right after a beat of
// our own went through: a reap that succeeds just after a failed beat (a database still starting
// up) would judge the others by a clock that ran while none of us could beat.
func (r *reapClock) beat(err error, now time.Time) bool {
	if err != nil {
		return false
	}
	r.ok(now)
	return r.mayReap(now)
}

func (r *reapClock) ok(now time.Time) {
	if r.upSince.IsZero() || now.Sub(r.lastOK) >= r.gap {
		r.upSince = now
	}
	r.lastOK = now
}

func (r *reapClock) mayReap(now time.Time) bool {
	return !r.upSince.IsZero() && now.Sub(r.upSince) >= r.staleAfter
}

func (f *Fanout) beat(ctx context.Context) error {
	// Shutdown gives a beat in flight a second to end instead of cutting it short: the server
	// may still run a cancelled upsert, and one that commits after Close deleted the instance
	// row brings the row back. Close waits for the heartbeat loop, so the row goes after the beat.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), f.cfg.Heartbeat*2)
	defer cancel()
	defer context.AfterFunc(ctx, func() { time.AfterFunc(time.Second, cancel) })()
	_, err := f.pool.Exec(cctx, `SELECT buzz.instance_heartbeat($1, $2, NULLIF($3, ''))`,
		f.cfg.InstanceID, f.slot, f.cfg.ListenAddr)
	if err != nil && ctx.Err() == nil {
		f.log.Warn("fan-out heartbeat failed", "err", err)
	}
	return err
}

func (f *Fanout) reap(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, f.cfg.Heartbeat*2)
	defer cancel()
	rows, err := f.pool.Query(cctx, `SELECT slot_name, coalesce(instance_id, ''), action FROM buzz.reap_instances($1)`, f.cfg.StaleAfter)
	if err != nil {
		if ctx.Err() == nil {
			f.log.Warn("fan-out reaping stale instances failed", "err", err)
		}
		return
	}
	defer rows.Close()
	for rows.Next() {
		var slot, inst, action string
		if rows.Scan(&slot, &inst, &action) == nil {
			f.log.Info("fan-out reaped a stale instance", "slot", slot, "instance", inst, "action", action, "stale_after", f.cfg.StaleAfter)
		}
	}
}
