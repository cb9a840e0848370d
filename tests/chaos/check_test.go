package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// violations collects evidence per check; a check with any entry fails the soak.
type violations struct {
	order []string
	m     map[string][]string
	ok    map[string]string // check -> what passed (printed)
}

func newViolations() *violations {
	return &violations{m: map[string][]string{}, ok: map[string]string{}}
}

func (v *violations) add(check, format string, args ...any) {
	if _, seen := v.m[check]; !seen {
		v.order = append(v.order, check)
	}
	v.m[check] = append(v.m[check], fmt.Sprintf(format, args...))
}

func (v *violations) pass(check, format string, args ...any) {
	v.ok[check] = fmt.Sprintf(format, args...)
}

type dbState struct {
	events    map[string]bool
	addrHead  map[string][2]any // "pubkey/d" -> {created_at int64, id string} for 30300
	members   map[string][]string
	hidden    map[string][]string // viewer -> hidden channel ids (canonical)
	viewers   map[string][2]int64 // viewer -> {target, published}
	snapshots map[string][]snapRow
	reminders map[string]reminderRow
}

type snapRow struct {
	id, pubkey string
	created    int64
	tags       nostr.Tags
}

type reminderRow struct {
	id, pubkey, d, state string
	notBefore            int64
	stamp                *int64
	confirmedAt          *time.Time
	claims, recoveries   int
}

func loadState(ctx context.Context, conn *pgx.Conn) (*dbState, error) {
	s := &dbState{events: map[string]bool{}, addrHead: map[string][2]any{}, members: map[string][]string{},
		hidden: map[string][]string{}, viewers: map[string][2]int64{}, snapshots: map[string][]snapRow{},
		reminders: map[string]reminderRow{}}
	err := eachRow(ctx, conn, `SELECT id, kind, pubkey, coalesce(d_tag,''), created_at FROM buzz.events`, func(rows pgx.Rows) error {
		var id, pk, d string
		var kind int
		var created int64
		if err := rows.Scan(&id, &kind, &pk, &d, &created); err != nil {
			return err
		}
		s.events[id] = true
		if kind == 30300 {
			s.addrHead[pk+"/"+d] = [2]any{created, id}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	err = eachRow(ctx, conn, `SELECT channel_id::text, pubkey, hidden_at IS NOT NULL FROM buzz.members ORDER BY 1, 2`, func(rows pgx.Rows) error {
		var ch, pk string
		var hid bool
		if err := rows.Scan(&ch, &pk, &hid); err != nil {
			return err
		}
		s.members[ch] = append(s.members[ch], pk)
		if hid {
			s.hidden[pk] = append(s.hidden[pk], ch)
		}
		if _, ok := s.viewers[pk]; !ok {
			s.viewers[pk] = [2]int64{-1, -1}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	err = eachRow(ctx, conn, `SELECT viewer, target_generation, published_generation FROM buzz.visibility_state`, func(rows pgx.Rows) error {
		var v string
		var tg, pg int64
		if err := rows.Scan(&v, &tg, &pg); err != nil {
			return err
		}
		s.viewers[v] = [2]int64{tg, pg}
		return nil
	})
	if err != nil {
		return nil, err
	}
	err = eachRow(ctx, conn, `SELECT id, pubkey, d_tag, created_at, tags FROM buzz.events WHERE kind = 30622`, func(rows pgx.Rows) error {
		var r snapRow
		var d string
		var tags []byte
		if err := rows.Scan(&r.id, &r.pubkey, &d, &r.created, &tags); err != nil {
			return err
		}
		if err := json.Unmarshal(tags, &r.tags); err != nil {
			return fmt.Errorf("snapshot %s: tags: %w", r.id, err)
		}
		s.snapshots[d] = append(s.snapshots[d], r)
		return nil
	})
	if err != nil {
		return nil, err
	}
	err = eachRow(ctx, conn, `SELECT id, pubkey, d_tag, state, not_before, stamp, confirmed_at, claims, recoveries FROM buzz.reminders`, func(rows pgx.Rows) error {
		var r reminderRow
		if err := rows.Scan(&r.id, &r.pubkey, &r.d, &r.state, &r.notBefore, &r.stamp, &r.confirmedAt, &r.claims, &r.recoveries); err != nil {
			return err
		}
		s.reminders[r.id] = r
		return nil
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// eachRow runs sql and calls fn on every row; the query's, fn's and rows.Err's errors are
// returned (a state read cut short must not look like a smaller, consistent state).
func eachRow(ctx context.Context, conn *pgx.Conn, sql string, fn func(pgx.Rows) error) error {
	rows, err := conn.Query(ctx, sql)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := fn(rows); err != nil {
			return fmt.Errorf("%s: %w", sql, err)
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("%s: %w", sql, err)
	}
	return nil
}

// dueEmission is one due signal found in the WAL by the soak's own logical slot.
type dueEmission struct {
	id     string
	stamp  int64
	commit pglogrepl.LSN // end of its transaction's commit
}

// observer reads every transactional logical message 'buzz' with t=due committed since the soak
// began (its slot was made before any relay started). A slot invalidation drains it (it must keep
// up then, or it is lost too); an immediate restart may hand a drained stretch out again, so
// emissions are kept once per message position.
type observer struct {
	mu   sync.Mutex
	seen map[string]bool
	out  []dueEmission
}

func newObserver() *observer { return &observer{seen: map[string]bool{}} }

// drain reads what the slot holds; consume moves the slot past it.
func (o *observer) drain(ctx context.Context, conn *pgx.Conn, consume bool) error {
	fn := "pg_logical_slot_peek_changes"
	if consume {
		fn = "pg_logical_slot_get_changes"
	}
	rows, err := conn.Query(ctx, `SELECT lsn::text, xid::text, data FROM `+fn+`('chaos_observer', NULL, NULL)
	                               WHERE data LIKE 'message: transactional: 1 prefix: buzz,%' OR data LIKE 'COMMIT %'`)
	if err != nil {
		return err
	}
	defer rows.Close()
	type pend struct {
		key string
		sig testenv.DueSignal
	}
	open := map[string][]pend{} // xid -> its messages until its COMMIT row
	o.mu.Lock()
	defer o.mu.Unlock()
	for rows.Next() {
		var lsn, xid, data string
		if err := rows.Scan(&lsn, &xid, &data); err != nil {
			return err
		}
		if strings.HasPrefix(data, "COMMIT") {
			commit, err := pglogrepl.ParseLSN(lsn)
			if err != nil {
				return err
			}
			for _, p := range open[xid] {
				if !o.seen[p.key] {
					o.seen[p.key] = true
					o.out = append(o.out, dueEmission{p.sig.ID(), p.sig.Stamp, commit})
				}
			}
			delete(open, xid)
			continue
		}
		sigs, err := testenv.DueSignals(data)
		if err != nil {
			return err
		}
		for n, sig := range sigs {
			open[xid] = append(open[xid], pend{fmt.Sprintf("%s/%d", lsn, n), sig})
		}
	}
	return rows.Err()
}

func (o *observer) emissions() []dueEmission {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]dueEmission(nil), o.out...)
}

func tagValues(ev *nostr.Event, name string) []string {
	var out []string
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == name {
			out = append(out, t[1])
		}
	}
	return out
}

// readable applies the read gates (docs/protocol.md, Read gates) to an event for a connection that had sent AUTH for
// the pubkeys in authed (the relay cannot have authenticated anyone it had not been asked to).
func readable(ev *nostr.Event, authed map[string]bool, members map[string][]string, relayPK string) (bool, string) {
	has := func(pk string) bool { return authed[pk] }
	for _, ch := range tagValues(ev, "h") {
		if ms, isDM := members[ch]; isDM {
			for _, m := range ms {
				if has(m) {
					return true, ""
				}
			}
			return false, "DM " + ch + " traffic to a non-member"
		}
	}
	switch {
	case ev.Kind >= 41010 && ev.Kind <= 41012, ev.Kind == 30300:
		if !has(ev.PubKey) {
			return false, fmt.Sprintf("kind %d of %s to someone else", ev.Kind, ev.PubKey[:12])
		}
	case ev.Kind == 30622, ev.Kind == 1059:
		ps := tagValues(ev, "p")
		if len(ps) == 0 || !has(ps[0]) {
			return false, fmt.Sprintf("kind %d for %v to someone else", ev.Kind, ps)
		}
		if ev.Kind == 30622 && ev.PubKey != relayPK {
			return false, "30622 not signed by the relay key"
		}
	}
	return true, ""
}

func sortedCopy(s []string) []string {
	c := append([]string(nil), s...)
	sort.Strings(c)
	return c
}

func short(s string) string {
	if len(s) > 12 {
		return s[:12]
	}
	return s
}

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.Format("15:04:05.000")
}
