package listener

import (
	"context"
	"math/rand/v2"
	"time"
)

// heartbeat registers this instance, then refreshes its row every cfg.Heartbeat and reaps the
// slots of instances silent for longer than cfg.StaleAfter. It runs beside the replication stream
// on the ordinary pool, so a process whose stream is reconnecting still counts as alive (its slot
// must survive exactly that).
func (f *Fanout) heartbeatLoop(ctx context.Context) {
	for {
		f.beat(ctx)
		f.reap(ctx)
		// Jitter keeps several processes started together from reaping in lockstep.
		d := f.cfg.Heartbeat + time.Duration(rand.Int64N(int64(f.cfg.Heartbeat)/10+1))
		select {
		case <-ctx.Done():
			return
		case <-time.After(d):
		}
	}
}

func (f *Fanout) beat(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, f.cfg.Heartbeat*2)
	defer cancel()
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
