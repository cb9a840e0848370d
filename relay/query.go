package relay

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// handleReq registers the subscription (replacing one with the same id), then runs the initial
// query in the background. Registration comes first so nothing committed during the query is
// lost: it arrives through Deliver and the per-subscription seen set drops the overlap.
func (c *conn) handleReq(subID string, filters []nostr.Filter) {
	c.mu.Lock()
	old := c.subs[subID]
	delete(c.subs, subID)
	c.mu.Unlock()
	if old != nil {
		old.close() // a REQ with the same id replaces the old subscription, whatever happens next
	}
	cfs, ok := c.admitFilters("REQ", subID, filters)
	if !ok {
		return
	}

	sub := newSubscription(c.ctx, subID, cfs)
	c.mu.Lock()
	if len(c.subs) >= c.s.cfg.MaxSubscriptions {
		c.mu.Unlock()
		sub.close()
		metrics.SubscriptionsRefused.WithLabelValues("connection").Inc()
		c.sendClosed(subID, fmt.Sprintf("restricted: too many subscriptions (max %d)", c.s.cfg.MaxSubscriptions))
		return
	}
	// Every live event is matched against every subscription on one goroutine: the values a
	// connection's filters hold in total bound what it costs there.
	held := sub.values
	for _, other := range c.subs {
		held += other.values
	}
	if held > maxConnFilterValues {
		c.mu.Unlock()
		sub.close()
		metrics.SubscriptionsRefused.WithLabelValues("filter_values").Inc()
		c.sendClosed(subID, fmt.Sprintf("restricted: too many filter values across this connection's subscriptions (max %d); close some first", maxConnFilterValues))
		return
	}
	if !c.s.ipSubs.take(c.ip) {
		c.mu.Unlock()
		sub.close()
		metrics.SubscriptionsRefused.WithLabelValues("ip").Inc()
		c.sendClosed(subID, fmt.Sprintf("restricted: too many subscriptions from your address across its connections (max %d); close some first", c.s.cfg.MaxSubscriptionsPerIP))
		return
	}
	sub.mu.Lock()
	sub.slot, sub.slotKey = c.s.ipSubs, c.ip // given back by sub.close, however it ends
	sub.mu.Unlock()
	c.subs[subID] = sub
	// Counted from here on: a Deliver that looked for candidates before this line skips this
	// connection. A stored event it carried is in the recent window by then (Deliver adds it
	// before it looks), so the matching below still finds it for a filter with a query. An
	// ephemeral event, or one only a limit-0 filter matches, is missed in that window, as one
	// delivered just before the REQ arrived is: the two were concurrent.
	c.s.interest.watch(c, sub)
	c.mu.Unlock()
	// Taken now, not after the query: however long the query waits, what was delivered just
	// before the subscription existed is still at hand (recentStored).
	before := c.s.recent.matching(sub, timeNow())
	hooks.At(sub.ctx, "relay.req.registered")

	if !c.acquireQuery(sub.ctx) {
		return
	}
	go func() {
		defer c.releaseQuery()
		defer c.recoverQuery(subID, sub)
		c.runInitial(sub, before)
	}()
}

// checkGates applies the gate closing rule to every filter: one filter that can only match
// unreadable rows closes the whole REQ, so the client learns it should AUTH (a subscription
// cannot be half closed, and silently dropping part of it would leave the client waiting).
// The member sets of every h value in the request are read at once, on the query pool.
func (c *conn) checkGates(cfs []*compiledFilter) string {
	authed := c.authedList()
	var channels []string
	if len(authed) > 0 {
		for _, cf := range cfs {
			if !cf.none && cf.hasTag("h") {
				channels = append(channels, cf.tag("h")...)
			}
		}
	}
	var sets map[string][]string
	if len(channels) > 0 {
		ctx, cancel := context.WithTimeout(c.ctx, c.s.memberWait)
		var err error
		sets, err = c.lookupMembers(ctx, channels)
		cancel()
		if err != nil {
			c.log.Warn("membership lookup failed", "err", err)
			return "error: could not check channel membership"
		}
	}
	for _, cf := range cfs {
		if reason := gateClosure(cf, authed, sets); reason != "" {
			return reason
		}
	}
	return ""
}

// lookupMembers reads member sets on the query pool within the client's share of it, like a query
// (queryConn): REQs naming many channels must not let one client hold more of the pool than that.
// Sets all in the cache cost nothing: a busy client's REQs naming its DMs do not wait for its share.
func (c *conn) lookupMembers(ctx context.Context, channels []string) (map[string][]string, error) {
	if sets, ok := c.s.members.cached(channels); ok {
		return sets, nil
	}
	if !c.s.ipQueries.acquire(ctx, c.ip) {
		return nil, ctx.Err()
	}
	defer c.s.ipQueries.release(c.ip)
	return c.s.members.membersOf(ctx, c.s.query, channels)
}

func (c *conn) acquireQuery(ctx context.Context) bool {
	select {
	case c.querySem <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (c *conn) releaseQuery() { <-c.querySem }

// queryConn takes one of the client's share of the query pool (ipQueries), then a connection.
// The share is held while the query runs and its rows are read, not while they are sent: a
// client reading slowly must not hold its office's share.
func (c *conn) queryConn(ctx context.Context) (pc *pgxpool.Conn, release func(), err error) {
	if !c.s.ipQueries.acquire(ctx, c.ip) {
		return nil, nil, ctx.Err()
	}
	pc, err = c.s.acquireQueryConn(ctx)
	if err != nil {
		c.s.ipQueries.release(c.ip)
		return nil, nil, err
	}
	return pc, func() { pc.Release(); c.s.ipQueries.release(c.ip) }, nil
}

// recoverQuery answers a query goroutine's panic with CLOSED. sub is the REQ's subscription (nil
// for COUNT): a CLOSED subscription must not go on delivering live events, and a COUNT's CLOSED
// ends a REQ of its id (closeID).
func (c *conn) recoverQuery(subID string, sub *subscription) {
	if p := recover(); p != nil {
		c.log.Error("panic in query", "sub", subID, "panic", p, "stack", string(debug.Stack()))
		if sub == nil {
			c.closeID(subID, "error: internal error")
			return
		}
		if sub.ctx.Err() != nil {
			return // closed or replaced: a CLOSED now would name its successor
		}
		c.endSub(sub, "error: internal error")
	}
}

type storedRow struct {
	id   string
	json []byte
}

// runInitial runs the REQ's initial query, sends the rows the subscription has not seen yet, the
// stored events delivered before it existed that the query's snapshot missed (replayUnseen), then
// EOSE. The rows are read completely (bounded by maxInitialBytes) before sending, so a slow client
// holds no database connection.
func (c *conn) runInitial(sub *subscription, before []evt.Delivery) {
	rows, held, snap, err := c.queryStored(sub.ctx, sub.filters)
	// Each row gives its bytes back once it is in the send queue (bounded per connection), so a
	// slow reader holds only what it has not taken yet; the rest comes back when this returns.
	defer func() { c.releaseInitial(held) }()
	if errors.Is(err, errBudgetSpent) {
		// Every byte of the budget is held by answers still being sent. An empty EOSE would read
		// as "no history"; say it instead (unless the client closed or replaced this REQ).
		if sub.ctx.Err() != nil {
			return
		}
		hooks.At(sub.ctx, "relay.req.busy")
		c.endSub(sub, "error: relay busy, try again")
		hooks.At(sub.ctx, "relay.req.busy.ended")
		return
	}
	if err != nil {
		if sub.ctx.Err() != nil {
			return // closed, replaced, or the connection went away
		}
		c.endSub(sub, queryErrorReason(err))
		if !isTimeout(err) {
			c.log.Error("REQ query failed", "sub", sub.id, "err", err)
		}
		return
	}
	hooks.At(sub.ctx, "relay.req.queried")
	before = unseenBy(snap, before) // keep only what may be sent: a slow reader holds no more
	// From here on, live events the query's snapshot saw are not sent (unless they also match a
	// filter with limit 0, which had no query, and no row sent them: sentAsRow): the query
	// answered them, or passed them over (limit, budget, replaced, deleted). Those that came live
	// while it ran are in seen, and their rows are skipped below.
	sub.mu.Lock()
	sub.snap = snap
	sub.mu.Unlock()
	for i, r := range rows {
		key := keyOf(r.id)
		sent := sub.sendLocked(c, eventMessage(sub.prefix, r.json), func() bool {
			if _, live := sub.sentLive[key]; live || sub.seen.has(key) {
				return false
			}
			sub.recordRow(key) // for a filter with limit 0 (sentAsRow)
			return true
		})
		if !sent {
			return
		}
		// The queue holds its own copy now: drop ours, or the budget would count bytes that are
		// gone while the slice still holds them.
		rows[i].json = nil
		c.releaseInitial(int64(len(r.json)))
		held -= int64(len(r.json))
	}
	if !c.replayUnseen(sub, before) {
		return
	}
	sub.mu.Lock()
	sub.sentLive = nil // the rows and the replay are out: live deliveries from now on are new to them
	// From here on the fan-out's own de-dup (stream position and change count) is exact, and an
	// ephemeral event sent again to this process is answered duplicate: (recentEphemeral); seen is
	// left with what neither catches (one event sent to two processes, or stored again after its
	// replacement was deleted), so a shorter window does: 4,096 ids cost about 224 KiB per
	// subscription for as long as it lives, 1,024 about 51 KiB (relay/seen_test.go).
	sub.seen.shrink(seenAfterEOSE)
	sub.mu.Unlock()
	sub.sendLocked(c, marshalArray("EOSE", sub.id), nil)
}

// replayUnseen sends the deliveries that came before the subscription existed and that its
// query's snapshot did not see (unseen: committed, decoded, but not yet visible to other sessions
// when the query ran). Gates as in Deliver; seen drops what already came live. It returns false
// when the subscription is done, closed here if a member set could not be read (dropping a gated
// event silently would leave a gap the client cannot see).
func (c *conn) replayUnseen(sub *subscription, unseen []evt.Delivery) bool {
	now := timeNow()
	for _, d := range unseen {
		if expired(d.Event, now.Unix()) {
			continue
		}
		ok, err := c.mayRead(sub.ctx, d)
		if err != nil {
			if sub.ctx.Err() == nil {
				c.log.Warn("membership lookup failed for a REQ; subscription closed", "sub", sub.id, "err", err)
				c.endSub(sub, "error: could not check channel membership, try again")
			}
			return false
		}
		if !ok {
			continue
		}
		id := keyOf(d.Event.ID)
		// sentLive as for the rows: seen alone may have evicted an event that came live meanwhile.
		if !sub.sendLocked(c, eventMessage(sub.prefix, eventJSON(d.Event)), func() bool {
			if _, live := sub.sentLive[id]; live {
				return false
			}
			return sub.seen.add(id)
		}) {
			return false
		}
	}
	return true
}

// unseenBy keeps the deliveries whose transactions snap did not see (none without a snapshot:
// there was no query to miss them).
func unseenBy(snap *mvccSnapshot, ds []evt.Delivery) []evt.Delivery {
	if snap == nil {
		return nil
	}
	var out []evt.Delivery
	for _, d := range ds {
		if !snap.sees(d.Xid) {
			out = append(out, d)
		}
	}
	return out
}

// mayRead is the live read gate for one connection (Deliver's), with a member lookup on the
// query pool within the client's share.
func (c *conn) mayRead(ctx context.Context, d evt.Delivery) (bool, error) {
	var members []string
	if d.Scope.Kind == evt.ScopeChannel {
		if len(c.authedList()) == 0 {
			return false, nil // only members read it, and this connection is nobody yet
		}
		ctx, cancel := context.WithTimeout(ctx, c.s.memberWait)
		sets, err := c.lookupMembers(ctx, []string{d.Scope.Channel})
		cancel()
		if err != nil {
			return false, err
		}
		members = sets[d.Scope.Channel]
	}
	return d.Scope.Readable(d.Event.PubKey, c.authedList(), func(channel, pubkey string) bool {
		_, ok := slices.BinarySearch(members, pubkey)
		return ok && channel == d.Scope.Channel
	}), nil
}

// sendLocked enqueues msg for sub, deciding (want, under sub.mu) and enqueueing in one critical
// section, so that nothing is sent for a subscription once it is closed or replaced, and a live
// delivery of the same id cannot slip between the de-dup check and the enqueue. It waits for room
// outside the lock (Deliver takes sub.mu and must never wait for a client). It returns false when
// the subscription or connection is done.
func (sub *subscription) sendLocked(c *conn, msg []byte, want func() bool) bool {
	decided := false
	for {
		sub.mu.Lock()
		if sub.closed {
			sub.mu.Unlock()
			return false
		}
		if !decided && want != nil {
			if !want() {
				sub.mu.Unlock()
				return true
			}
			decided = true
		}
		ok, room, done := c.q.pushHalf(msg)
		sub.mu.Unlock()
		if ok {
			return true
		}
		if done {
			return false
		}
		select {
		case <-room:
		case <-sub.ctx.Done():
			return false
		}
	}
}

// queryStored reads the initial rows of filters, newest first, de-duplicated across filters, and
// the snapshot they were read in. held is what the rows took from the process-wide budget; the
// caller gives it back once they are sent.
func (c *conn) queryStored(ctx context.Context, filters []*compiledFilter) (out []storedRow, held int64, snap *mvccSnapshot, err error) {
	sql, args := reqSQL(filters, c.authedList())
	if sql == "" {
		return nil, 0, nil, nil
	}
	defer func() {
		if p := recover(); p != nil {
			c.releaseInitial(held) // recoverQuery answers the client; the bytes must come back
			panic(p)
		}
		if err != nil {
			c.releaseInitial(held)
			out, held, snap = nil, 0, nil
		}
	}()
	ctx, cancel := context.WithTimeout(ctx, c.s.cfg.QueryTimeout)
	defer cancel()
	start := time.Now()
	defer func() { metrics.Queries.WithLabelValues("REQ").Observe(time.Since(start).Seconds()) }()
	pc, release, err := c.queryConn(ctx)
	if err != nil {
		return nil, 0, nil, err
	}
	defer release()
	// The snapshot and the rows come from one transaction, so from one snapshot; all four
	// statements go in one round trip.
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
		return nil, 0, nil, err
	}
	var snapText string
	var walPos int64
	if err = br.QueryRow().Scan(&snapText, &walPos); err != nil {
		return nil, 0, nil, err
	}
	if snap, err = parseMVCCSnapshot(snapText); err != nil {
		return nil, 0, nil, err
	}
	snap.walPos = uint64(walPos)
	rows, err := br.Query()
	if err != nil {
		return nil, 0, nil, err
	}
	defer rows.Close()
	var ev nostr.Event
	var tags string
	total := 0
	prev := ""
	for rows.Next() {
		var kind int32
		var createdAt int64
		if err := rows.Scan(&ev.ID, &ev.PubKey, &createdAt, &kind, &tags, &ev.Content, &ev.Sig); err != nil {
			return out, held, nil, err
		}
		if ev.ID == prev {
			continue // the same row matched by another filter: adjacent in (created_at, id) order
		}
		prev = ev.ID
		ev.CreatedAt = nostr.Timestamp(createdAt)
		ev.Kind = int(kind)
		js := storedEventJSON(&ev, tags)
		total += len(js)
		if total > maxInitialBytes {
			metrics.InitialTruncated.WithLabelValues("query").Inc()
			c.log.Debug("initial query truncated", "bytes", maxInitialBytes, "rows", len(out))
			break
		}
		if bound := c.takeInitial(int64(len(js))); bound != "" {
			// Every connection's answers together stay within the budget, and one connection's
			// (one client IP's) within its share: this one gets the newest rows that fit (NIP-01
			// lets a relay return fewer than limit), or, when not one fits, a CLOSED that says why.
			metrics.InitialTruncated.WithLabelValues(bound).Inc()
			c.log.Debug("initial query truncated", "bound", bound, "rows", len(out))
			if len(out) == 0 {
				return nil, 0, nil, errBudgetSpent
			}
			break
		}
		held += int64(len(js))
		out = append(out, storedRow{id: ev.ID, json: js})
	}
	rows.Close()
	if err = rows.Err(); err != nil {
		return out, held, nil, err
	}
	if _, err = br.Exec(); err != nil { // COMMIT
		return out, held, nil, err
	}
	return out, held, snap, nil
}

// abandonTx ends a transaction an error left open on pc (a statement timeout, say), so the
// connection goes back to the pool instead of being dropped by it and opened again (under
// overload, when timeouts come, that would add a backend start to each). A closed connection
// is left to the pool.
func abandonTx(pc *pgxpool.Conn) {
	if pc.Conn().IsClosed() || pc.Conn().PgConn().TxStatus() == 'I' {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, _ = pc.Exec(ctx, `ROLLBACK`)
}

// takeInitial takes n bytes of initial results for this connection: from its share, its client
// IP's share, then the process-wide budget; all of them or none. It returns "" or the bound that
// refused them ("connection", "ip", "budget").
func (c *conn) takeInitial(n int64) string {
	if c.initialHeld.Add(n) > c.s.cfg.InitialResultPerConn {
		c.initialHeld.Add(-n)
		return "connection"
	}
	if !c.s.ipInitial.take(c.ip, n) {
		c.initialHeld.Add(-n)
		return "ip"
	}
	if !c.s.initial.take(n) {
		c.s.ipInitial.release(c.ip, n)
		c.initialHeld.Add(-n)
		return "budget"
	}
	return ""
}

// releaseInitial gives back n bytes taken by takeInitial, to every bound that gave them.
func (c *conn) releaseInitial(n int64) {
	c.initialHeld.Add(-n)
	c.s.ipInitial.release(c.ip, n)
	c.s.initial.release(n)
}

// errBudgetSpent: not one row of an answer fit in the process-wide budget or a share of it.
var errBudgetSpent = errors.New("initial result budget spent")

// byteBudget bounds bytes held across connections (initial results waiting to be sent).
type byteBudget struct {
	limit int64
	used  atomic.Int64
}

func (b *byteBudget) take(n int64) bool {
	if b.used.Add(n) > b.limit {
		b.used.Add(-n)
		return false
	}
	metrics.InitialBytes.Add(float64(n))
	return true
}

func (b *byteBudget) release(n int64) {
	if n != 0 {
		b.used.Add(-n)
		metrics.InitialBytes.Sub(float64(n))
	}
}

// storedEventJSON builds an event's JSON from a row; tags come as jsonb text, already JSON.
func storedEventJSON(ev *nostr.Event, tagsJSON string) []byte {
	w := newWriter()
	writeEventHead(w, ev)
	w.RawString(`,"tags":`)
	w.RawString(tagsJSON)
	w.RawString(`,"content":`)
	w.String(ev.Content)
	w.RawString(`,"sig":`)
	w.String(ev.Sig)
	w.RawByte('}')
	b, _ := w.BuildBytes()
	return b
}

// admitFilters is what REQ and COUNT both pass before any query: the rate limit, the filter
// compiler and the read gates. On refusal it has already answered CLOSED, and ended a REQ of the
// same id (closeID: a REQ has already replaced it, a COUNT's CLOSED reads as its end).
func (c *conn) admitFilters(verb, subID string, filters []nostr.Filter) ([]*compiledFilter, bool) {
	if !c.allowReq(verb) {
		c.closeID(subID, "rate-limited: too many requests, slow down")
		return nil, false
	}
	cfs, err := c.compileFilters(filters)
	if err != nil {
		c.closeID(subID, "invalid: "+err.Error())
		return nil, false
	}
	if reason := c.checkGates(cfs); reason != "" {
		c.closeID(subID, reason)
		return nil, false
	}
	return cfs, true
}

// handleCount answers NIP-45 COUNT with the same gates as REQ. A refusal or a failure is a
// CLOSED (NIP-45) that also ends a REQ of the same id (closeID).
func (c *conn) handleCount(subID string, filters []nostr.Filter) {
	cfs, ok := c.admitFilters("COUNT", subID, filters)
	if !ok {
		return
	}
	if !c.acquireQuery(c.ctx) {
		return
	}
	go func() {
		defer c.releaseQuery()
		defer c.recoverQuery(subID, nil)
		n, err := c.count(c.ctx, cfs)
		if err != nil {
			if c.ctx.Err() != nil {
				return
			}
			if !isTimeout(err) {
				c.log.Error("COUNT query failed", "sub", subID, "err", err)
			}
			c.closeID(subID, queryErrorReason(err))
			return
		}
		c.send(marshalCount(subID, n))
	}()
}

func (c *conn) count(ctx context.Context, cfs []*compiledFilter) (int64, error) {
	sql, args := countSQL(cfs, c.authedList())
	if sql == "" {
		return 0, nil
	}
	ctx, cancel := context.WithTimeout(ctx, c.s.cfg.QueryTimeout)
	defer cancel()
	start := time.Now()
	defer func() { metrics.Queries.WithLabelValues("COUNT").Observe(time.Since(start).Seconds()) }()
	pc, release, err := c.queryConn(ctx)
	if err != nil {
		return 0, err
	}
	defer release()
	var n int64
	err = pc.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

// acquireQueryConn takes a query-pool connection whose session statement_timeout is the query
// timeout. The context deadline already cancels a query from Go; the server-side timeout also
// ends it when the cancel request cannot reach PostgreSQL. Set once per physical connection.
func (s *Server) acquireQueryConn(ctx context.Context) (*pgxpool.Conn, error) {
	pc, err := s.query.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	key := pc.Conn().PgConn()
	if _, done := s.timeoutSet.Load(key); !done {
		ms := strconv.FormatInt(s.cfg.QueryTimeout.Milliseconds(), 10)
		if _, err := pc.Exec(ctx, `SELECT set_config('statement_timeout', $1, false)`, ms); err != nil {
			pc.Release()
			return nil, err
		}
		if s.timeoutSetLen.Add(1) > 10000 {
			// Closed connections leave entries behind; forgetting all of them only costs one
			// more set_config per live connection.
			s.timeoutSet.Clear()
			s.timeoutSetLen.Store(0)
		}
		s.timeoutSet.Store(key, struct{}{})
	}
	return pc, nil
}

func isTimeout(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "57014" { // query_canceled (statement_timeout)
		return true
	}
	return errors.Is(err, context.DeadlineExceeded)
}

func queryErrorReason(err error) string {
	if isTimeout(err) {
		return "error: query timed out"
	}
	return "error: query failed"
}
