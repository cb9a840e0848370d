package relay

import (
	"errors"
	"fmt"

	"github.com/nbd-wtf/go-nostr"

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
	if !c.register(sub) {
		return
	}
	// Taken now, not after the query: however long the query waits, what was delivered just
	// before the subscription existed is still at hand (recentStored).
	before := c.s.recent.take(sub, timeNow())
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

// register makes sub the live subscription of its id, within the bounds on what one connection
// and one client IP may hold; a refusal closes sub and answers CLOSED.
func (c *conn) register(sub *subscription) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	refuse := func(bound, reason string) bool {
		sub.close()
		metrics.SubscriptionsRefused.WithLabelValues(bound).Inc()
		c.sendClosed(sub.id, reason)
		return false
	}
	if len(c.subs) >= c.s.cfg.MaxSubscriptions {
		return refuse("connection", fmt.Sprintf("restricted: too many subscriptions (max %d)", c.s.cfg.MaxSubscriptions))
	}
	// Every live event is matched against every subscription on one goroutine: the values a
	// connection's filters hold in total bound what it costs there.
	held := sub.values
	for _, other := range c.subs {
		held += other.values
	}
	if held > maxConnFilterValues {
		return refuse("filter_values", fmt.Sprintf("restricted: too many filter values across this connection's subscriptions (max %d); close some first", maxConnFilterValues))
	}
	if !c.s.ipSubs.take(c.ip, 1, false) {
		return refuse("ip", fmt.Sprintf("restricted: too many subscriptions from your address across its connections (max %d); close some first", c.s.cfg.MaxSubscriptionsPerIP))
	}
	if !c.s.allSubs.take("", 1, false) {
		c.s.ipSubs.give(c.ip, 1)
		return refuse("process", fmt.Sprintf("restricted: the relay holds as many subscriptions as it may (max %d); try again later", c.s.cfg.MaxSubscriptionsTotal))
	}
	sub.mu.Lock()
	sub.slot, sub.slotKey = c.s.ipSubs, c.ip // given back by sub.close, however it ends
	sub.allSlot = c.s.allSubs
	sub.seen.budget = c.s.dedup // its window grows within the process's budget from now on
	sub.mu.Unlock()
	c.subs[sub.id] = sub
	// Counted from here on: a Deliver that looked for candidates before this line skips this
	// connection. A stored event it carried is in the recent window by then (Deliver adds it
	// before it looks), so the matching below still finds it for a filter with a query. An
	// ephemeral event, or one only a limit-0 filter matches, is missed in that window, as one
	// delivered just before the REQ arrived is: the two were concurrent.
	c.s.interest.watch(c, sub)
	return true
}

// runInitial runs the REQ's initial query, sends the rows the subscription has not seen yet, the
// stored events delivered before it existed that the query's snapshot missed (replayUnseen), then
// EOSE. The rows are read completely (bounded by maxInitialBytes) before sending, so a slow client
// holds no database connection.
func (c *conn) runInitial(sub *subscription, before taken) {
	rows, held, snap, err := c.queryStored(sub.ctx, sub.filters, sub.prefix)
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
	unseen := before.unseen(snap, sub) // only what may be sent: a slow reader holds no more
	// From here on, live events the query's snapshot saw are not sent (unless they also match a
	// filter with limit 0, which had no query, and no row sent them: sentAsRow): the query
	// answered them, or passed them over (limit, budget, replaced, deleted). Those that came live
	// while it ran are in seen, and their rows are skipped below.
	// What the fan-out handed this connection before now is matched first, without the snapshot
	// (drainInbox), as when the fan-out matched every delivery itself.
	c.drainInbox(func() {
		sub.mu.Lock()
		sub.snap = snap
		sub.mu.Unlock()
	})
	for i, r := range rows {
		sent := sub.sendFrameLocked(c, r.msg, true, func() bool {
			if _, live := sub.sentLive[r.key]; live || sub.seen.has(r.key) {
				return false
			}
			sub.recordRow(r.key) // for a filter with limit 0 (sentAsRow)
			return true
		})
		if !sent {
			return
		}
		// The queue holds the message now: drop ours, or the budget would count bytes that are
		// gone once the queue lets them go while the slice still holds them.
		rows[i].msg = nil
		c.releaseInitial(int64(r.size))
		held -= int64(r.size)
	}
	if !c.replayUnseen(sub, unseen) {
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

// sendLocked enqueues msg for sub, deciding (want, under sub.mu) and enqueueing in one critical
// section, so that nothing is sent for a subscription once it is closed or replaced, and a live
// delivery of the same id cannot slip between the de-dup check and the enqueue. It waits for room
// outside the lock (Deliver takes sub.mu and must never wait for a client). It returns false when
// the subscription or connection is done.
func (sub *subscription) sendLocked(c *conn, msg []byte, want func() bool) bool {
	return sub.sendFrameLocked(c, msg, false, want)
}

// sendFrameLocked is sendLocked; owned says msg is a frame from getFrame that nothing else refers
// to once queued (sendQueue.pushOwned).
func (sub *subscription) sendFrameLocked(c *conn, msg []byte, owned bool, want func() bool) bool {
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
		ok, room, done := c.q.pushHalfFrame(msg, owned)
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
