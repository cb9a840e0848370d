package relay

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/logx"
)

// memberCache holds DM member sets. A DM's participant set never changes through the protocol
// (docs/protocol.md), so a non-empty set read once stays true until an operator edits member rows,
// which the database announces through the replication stream (forget); an empty answer is not
// cached (the channel may be committing right now, or not exist). Bounded: the oldest channel is
// forgotten first. Lookups
// run on the pool the caller names: REQ/COUNT gates on the query pool (client-driven, rate limited,
// may be saturated), Deliver on its own small pool (SetLookupPool), so neither a flood of filters
// naming channels nor expensive REQs can take connections acceptance needs, and a flood of EVENTs
// does not hold up live delivery.
type memberCache struct {
	mu    sync.Mutex
	sets  map[string][]string // channel uuid (canonical text) -> sorted member pubkeys
	order []string            // FIFO ring of cached channels
	next  int
	cap   int
	// epoch counts forgets: a lookup that read before one must not cache what it read (it may
	// be the set the edit replaced).
	epoch uint64
	// pending are the transactions of forgets no lookup's snapshot has seen yet. A commit is
	// decoded (and its forget arrives) before other sessions can see it, for as long as a
	// synchronous standby takes to answer, so a lookup after a forget may still read the old
	// set: its answer counts only once its snapshot sees every one of them (members_pending.go).
	pending []pendingForget
	log     *slog.Logger
	// unseenLog rate-limits the warning about a forget that stays unseen.
	unseenLog logx.Sampler
}

// errStaleMembers: the lookup's snapshot does not see an announced edit yet.
var errStaleMembers = errors.New("member lookup read before an announced edit was visible")

// forget drops the sets an announced member edit (of transaction xid, 0 if unknown) may have
// changed.
func (mc *memberCache) forget(ch evt.MembersChange, xid uint32) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	mc.epoch++
	// One transaction may announce many statements or rows: its id is waited for once.
	if xid != 0 && !slices.ContainsFunc(mc.pending, func(p pendingForget) bool { return p.xid == xid }) {
		mc.pending = append(mc.pending, pendingForget{xid: xid, at: timeNow()})
	}
	if ch.All {
		clear(mc.sets)
		return
	}
	for _, c := range ch.Channels {
		// Its slot in order stays until reused. Cached again meanwhile, the channel has a second
		// slot, and the older one evicts it early when reused: an extra lookup, never a stale set.
		delete(mc.sets, c)
	}
}

func newMemberCache(capacity int, log *slog.Logger) *memberCache {
	return &memberCache{sets: map[string][]string{}, cap: capacity, log: log, unseenLog: logx.Sampler{Every: unseenWarnAfter}}
}

func (mc *memberCache) get(channel string) ([]string, bool) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	s, ok := mc.sets[channel]
	return s, ok
}

func (mc *memberCache) put(channel string, members []string, readAt uint64) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if readAt != mc.epoch {
		return // read before a forget
	}
	if _, ok := mc.sets[channel]; ok {
		return
	}
	if len(mc.order) < mc.cap {
		mc.order = append(mc.order, channel)
	} else {
		delete(mc.sets, mc.order[mc.next])
		mc.order[mc.next] = channel
		mc.next = (mc.next + 1) % mc.cap
	}
	mc.sets[channel] = members
}

// cached returns the sets of channels when every one of them is in the cache (values that are not
// canonical UUIDs name no channel and need none).
func (mc *memberCache) cached(channels []string) (map[string][]string, bool) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	out := make(map[string][]string, len(channels))
	for _, ch := range channels {
		if !isCanonicalUUID(ch) {
			continue
		}
		s, ok := mc.sets[ch]
		if !ok {
			return nil, false
		}
		out[ch] = s
	}
	return out, true
}

// membersOf returns the member sets of the given channels (absent: no such channel / no members).
// Values that are not canonical UUIDs name no channel and are skipped without a query.
func (mc *memberCache) membersOf(ctx context.Context, pool *pgxpool.Pool, channels []string) (map[string][]string, error) {
	out := make(map[string][]string, len(channels))
	var missing []string
	for _, ch := range channels {
		if !isCanonicalUUID(ch) {
			continue
		}
		if s, ok := mc.get(ch); ok {
			out[ch] = s
		} else if !slices.Contains(missing, ch) {
			missing = append(missing, ch)
		}
	}
	if len(missing) == 0 {
		return out, nil
	}
	// A read that does not see a forget's transaction yet is read again, shortly: the gap is
	// usually a commit's last steps, but with synchronous replication it lasts until a standby
	// answers, however long that takes. Until then nobody's answer uses the old set (fail
	// closed): ctx (the caller's wait, and shutdown) ends the retries.
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		loaded, err := mc.load(ctx, pool, missing)
		if !errors.Is(err, errStaleMembers) {
			if err != nil {
				return nil, err
			}
			for ch, pks := range loaded {
				out[ch] = pks
			}
			return out, nil
		}
		hooks.At(ctx, "relay.members.stale")
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
	}
}

// load reads the member sets of channels, with the snapshot it read them in, and caches them
// unless a forget came meanwhile. errStaleMembers: the snapshot missed a forget's transaction.
// put caches nothing read while a forget is unseen: a forget after begin changes the epoch, and
// one before it (pending then) must be seen by the snapshot for load to get that far.
func (mc *memberCache) load(ctx context.Context, pool *pgxpool.Pool, channels []string) (map[string][]string, error) {
	readAt, began := mc.begin()
	rows, err := pool.Query(ctx, `
		SELECT s.snap, m.channel_id::text, m.pubkey
		  FROM (SELECT pg_current_snapshot()::text AS snap) s
		  LEFT JOIN buzz.members m ON m.channel_id = ANY($1::uuid[])`, channels)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	loaded := map[string][]string{}
	var snapText string
	for rows.Next() {
		var ch, pk *string
		if err := rows.Scan(&snapText, &ch, &pk); err != nil {
			return nil, err
		}
		if ch != nil && pk != nil {
			loaded[*ch] = append(loaded[*ch], *pk)
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	snap, err := parseMVCCSnapshot(snapText)
	if err != nil {
		return nil, err
	}
	if !mc.sawForgets(snap, began) {
		return nil, errStaleMembers
	}
	for ch, pks := range loaded {
		slices.Sort(pks)
		mc.put(ch, pks, readAt)
	}
	return loaded, nil
}

// anyMember reports whether any of pubkeys is a member of any of channels, by sets (membersOf's
// answer for at least those channels).
func anyMember(sets map[string][]string, channels, pubkeys []string) bool {
	for _, ch := range channels {
		members := sets[ch]
		for _, pk := range pubkeys {
			if _, ok := slices.BinarySearch(members, pk); ok {
				return true
			}
		}
	}
	return false
}

func isCanonicalUUID(s string) bool {
	if len(s) != 36 {
		return false
	}
	for i := 0; i < 36; i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
				return false
			}
		}
	}
	return true
}
