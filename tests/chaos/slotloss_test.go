package chaos

import (
	"context"
	"fmt"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/listener/fanout"
)

// slotGap is what one relay's live subscribers could miss: due signals committed after its old
// slot's confirmed position and before its new slot's start are in no slot it ever reads. The
// events stay stored (a REQ or a reconnect finds them); the due resend of a reminder is live only.
type slotGap struct {
	relay     int
	url       string
	from, to  pglogrepl.LSN
	at        time.Time
	newSlotIn time.Duration
}

func (g slotGap) covers(url string, commit pglogrepl.LSN) bool {
	return url == g.url && commit > g.from && commit <= g.to
}

// Slot invalidation: keep size while the WAL is moved on, and how much WAL to write past the held
// relay (six 16 MB segments: far beyond the keep size, while the others catch up).
const (
	slotKeepSize    = "32MB"
	slotKeepBytes   = 32 << 20
	slotWALSwitches = 6
)

// slotLoss holds relay i (SIGSTOP) while the WAL moves on, lets every other slot (the other relays'
// and the observer's) catch up, then lowers max_slot_wal_keep_size and checkpoints, so relay i's
// slot alone is invalidated (wal_status 'lost'). The relay then wakes and must make a new slot.
func (in *injector) slotLoss(i int) {
	defer func() {
		in.mu.Lock()
		in.exclusive = false
		in.mu.Unlock()
	}()
	w := in.open(i, fSlotLoss)
	defer in.close(w)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, in.dbURL)
	if err != nil {
		in.skip("slot invalidation of relay %d: connect: %v", i, err)
		return
	}
	defer conn.Close(context.Background())
	p := in.fl.proc(i)
	if p == nil {
		in.skip("slot invalidation of relay %d: it is down", i)
		return
	}
	slot := fanout.SlotName(in.fl.instance(i))
	others := func() []string { // the other relays' current slots (an exit restarted meanwhile makes a new one)
		var out []string
		for j := 0; j < 3; j++ {
			if j != i {
				out = append(out, fanout.SlotName(in.fl.instance(j)))
			}
		}
		return out
	}
	if _, ok := in.fl.signal(i, syscall.SIGSTOP); !ok {
		in.skip("slot invalidation of relay %d: SIGSTOP failed", i)
		return
	}
	thawed := false
	thaw := func() {
		if !thawed {
			thawed = true
			_ = syscall.Kill(p.Pid(), syscall.SIGCONT)
		}
	}
	defer thaw()
	in.note(fmt.Sprintf("slot invalidation: relay %d (slot %s) held by SIGSTOP while the WAL moves on", i, slot))
	var from pglogrepl.LSN
	var fromText string
	if err := conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&fromText); err != nil {
		in.skip("slot invalidation of relay %d: its slot %s: %v", i, slot, err)
		return
	}
	from, _ = pglogrepl.ParseLSN(fromText)
	if err := moveWAL(ctx, conn, others, func() error { return in.obs.drain(ctx, conn, true) }); err != nil {
		in.skip("slot invalidation of relay %d: %v", i, err)
		return
	}
	lost, err := invalidate(ctx, conn, slot)
	if err != nil || !lost {
		in.skip("slot invalidation of relay %d: slot not lost: %v", i, err)
		return
	}
	in.note(fmt.Sprintf("slot invalidation: slot %s is lost (wal_status), relay %d woken", slot, i))
	thaw()
	woke := time.Now()
	to, err := waitNewSlot(ctx, conn, slot)
	if err != nil {
		in.errf("slot invalidation: relay %d made no new slot %s within 60s of waking: %v", i, slot, err)
		return
	}
	in.mu.Lock()
	in.gaps = append(in.gaps, slotGap{relay: i, url: p.URL, from: from, to: to, at: woke, newSlotIn: time.Since(woke)})
	in.mu.Unlock()
	in.note(fmt.Sprintf("slot invalidation: relay %d made a new slot %.1fs after waking; live gap %s..%s", i, time.Since(woke).Seconds(), from, to))
}

func (in *injector) skip(format string, args ...any) {
	s := fmt.Sprintf(format, args...)
	in.mu.Lock()
	in.skipped = append(in.skipped, s)
	in.counts[fSlotLoss]-- // counted at open; an invalidation that did not happen is not one
	in.mu.Unlock()
	in.logf("fault skipped: %s", s)
}

// moveWAL writes slotWALSwitches segments of WAL, checkpoints (a running-xacts record lets logical
// slots move their restart point), and waits until the slots in others (and the observer's, which
// drain consumes) are within half the keep size of the head.
func moveWAL(ctx context.Context, conn *pgx.Conn, others func() []string, drain func() error) error {
	for k := 0; k < slotWALSwitches; k++ {
		if _, err := conn.Exec(ctx, `SELECT pg_logical_emit_message(false, 'chaos_wal', 'x')`); err != nil {
			return err
		}
		if _, err := conn.Exec(ctx, `SELECT pg_switch_wal()`); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for n := 0; ; n++ {
		if n%10 == 0 {
			if _, err := conn.Exec(ctx, `CHECKPOINT`); err != nil {
				return err
			}
		}
		if err := drain(); err != nil {
			return fmt.Errorf("observer: %w", err)
		}
		names := []string{"chaos_observer"}
		if others != nil {
			names = append(names, others()...)
		}
		var behind int64
		if err := conn.QueryRow(ctx, `SELECT coalesce(max(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)), 0)::bigint
		                                FROM pg_replication_slots WHERE slot_name = ANY($1)`, names).Scan(&behind); err != nil {
			return err
		}
		if behind < slotKeepBytes/2 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the other slots stayed %d bytes behind the head", behind)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// invalidate lowers max_slot_wal_keep_size, checkpoints until slot is lost, and puts the setting back.
func invalidate(ctx context.Context, conn *pgx.Conn, slot string) (bool, error) {
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET max_slot_wal_keep_size = '`+slotKeepSize+`'`); err != nil {
		return false, err
	}
	defer func() {
		_, _ = conn.Exec(context.Background(), `ALTER SYSTEM RESET max_slot_wal_keep_size`)
		_, _ = conn.Exec(context.Background(), `SELECT pg_reload_conf()`)
	}()
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		return false, err
	}
	for try := 0; try < 10; try++ {
		time.Sleep(500 * time.Millisecond) // the checkpointer reads the new setting
		if _, err := conn.Exec(ctx, `CHECKPOINT`); err != nil {
			return false, err
		}
		var st string
		if err := conn.QueryRow(ctx, `SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&st); err != nil {
			return false, err
		}
		if st == "lost" {
			return true, nil
		}
	}
	return false, nil
}

// waitNewSlot waits until slot exists again and is not lost; its start is its first confirmed position.
func waitNewSlot(ctx context.Context, conn *pgx.Conn, slot string) (pglogrepl.LSN, error) {
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		var lsn *string
		err := conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots
		                            WHERE slot_name = $1 AND coalesce(wal_status, '') <> 'lost'`, slot).Scan(&lsn)
		if err == nil && lsn != nil {
			return pglogrepl.ParseLSN(*lsn)
		}
		if err != nil && err != pgx.ErrNoRows {
			return 0, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	return 0, fmt.Errorf("timed out")
}
