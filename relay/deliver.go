package relay

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/metrics"
)

// live is one delivery on its way to connections: an event, or a due signal (due, with its
// stamp). A due signal carries no transaction id: no query answered it, it is always new.
type live struct {
	evt.Delivery
	due   bool
	stamp int64
}

// DeliverEvent fans one stored or ephemeral event out to every matching live subscription this
// process holds, after the read gate (deliver).
func (s *Server) DeliverEvent(d evt.Delivery) { s.deliver(live{Delivery: d}) }

// DeliverDue fans a reminder's due signal out to its author's matching live subscriptions: due
// signals are author-only (docs/protocol.md), whatever scope their emitter wrote.
func (s *Server) DeliverDue(d evt.Due) {
	author := evt.Scope{Kind: evt.ScopeAuthor}
	s.deliver(live{Delivery: evt.Delivery{Event: d.Event, Scope: author, CommitLSN: d.CommitLSN}, due: true, stamp: d.Stamp})
}

// MembersChanged forgets the cached member sets of the channels whose rows changed; the check of
// the pending forgets against a fresh snapshot runs off the delivery goroutine (settleSoon).
func (s *Server) MembersChanged(c evt.MembersChange) {
	s.members.forget(c, c.Xid)
	s.settleSoon()
}

// StreamRestarted forgets every member set and every subscription's query snapshot: the stream
// restarted on a new slot, so member edits announced meanwhile were lost, and transaction ids and
// WAL positions from before it say nothing about what comes next.
func (s *Server) StreamRestarted() {
	s.members.dropPending()
	s.members.forget(evt.MembersChange{All: true}, 0)
	s.dropSnapshots()
}

// deliver never waits for a client, nor matches for one: it finds the candidate connections,
// checks the read gate and hands the event to each one's inbox (inbox.go), where the connection's
// own goroutine matches it; a connection whose inbox or send queue is full is closed as a slow
// reader. The only wait is a member-set lookup for a DM not seen before that a subscription here
// matches (then cached until an operator's edit of its member rows is announced, which
// MembersChanged receives, and checks against one snapshot read). A lookup that fails, or that
// cannot see an announced edit yet (however long a synchronous standby keeps its commit
// invisible), is retried until it succeeds or the server shuts down: the replication stream (our
// caller) waits, and acknowledges nothing past this event meanwhile, instead of losing a gated
// event its members are subscribed to or giving it to a member the edit removed.
func (s *Server) deliver(d live) {
	if d.Event == nil || expired(d.Event, timeNow().Unix()) {
		return // NIP-40: an event that expired while it travelled (replication lag) is not served
	}
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("panic in deliver", "panic", p, "id", d.Event.ID)
		}
	}()
	ix := newTagIndex(d.Event)
	if d.Xid != 0 && !d.due && !isEphemeral(d.Event.Kind) {
		// Kept before any connection sees it, for a REQ whose query misses it (recentStored).
		s.recent.add(d.Delivery, ix, timeNow())
	}
	var members []string
	if d.Scope.Kind == evt.ScopeChannel {
		// A DM no subscription here matches costs no lookup: a client posting round-robin to
		// more DMs than the cache holds would otherwise make every process wait for one lookup
		// per event, on the goroutine all live delivery goes through, for nobody.
		if _, cached := s.members.get(d.Scope.Channel); !cached &&
			(!s.interest.mayMatch(d.Event) || !s.anySubscriptionMatches(d, ix)) {
			return
		}
		var ok bool
		if members, ok = s.deliveryMembers(d.Delivery); !ok {
			return // shutting down
		}
	}
	isMember := func(channel, pubkey string) bool {
		if channel != d.Scope.Channel {
			return false
		}
		_, ok := slices.BinarySearch(members, pubkey)
		return ok
	}
	var js []byte // built on first match, shared by all connections
	for _, c := range s.recipients(d.Delivery, members) {
		if !d.Scope.Readable(d.Event.PubKey, c.authedList(), isMember) {
			continue
		}
		if js == nil {
			js = eventJSON(d.Event)
		}
		c.queueLive(d, js, ix)
	}
}

// dropSnapshots makes every subscription forget its query's snapshot: the stream restarted on a
// new slot (after a failover, say), and WAL positions and transaction ids from before it may be
// reused. Each connection first matches the deliveries from before the restart, which the old
// snapshots still judge: on this goroutine, but only at a restart.
func (s *Server) dropSnapshots() {
	for _, c := range s.snapshotConns() {
		c.drainInbox(c.dropSnapshots)
	}
}

// expired reports whether ev carries a NIP-40 expiration at or before now. accept_event refuses
// malformed values, so one that does not parse is treated as none.
func expired(ev *nostr.Event, now int64) bool {
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == "expiration" {
			at, err := strconv.ParseInt(t[1], 10, 64)
			return err == nil && at <= now
		}
	}
	return false
}

// deliveryMembers reads the member set of d's channel on the lookup pool (SetLookupPool),
// retrying with capped backoff. Nobody gets a gated event whose gate could not be checked (fail
// closed); ok is false only when the server is shutting down.
func (s *Server) deliveryMembers(d evt.Delivery) (members []string, ok bool) {
	backoff := 10 * time.Millisecond
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithTimeout(s.stop, s.memberWait)
		sets, err := s.members.membersOf(ctx, s.lookup, []string{d.Scope.Channel})
		cancel()
		if err == nil {
			return sets[d.Scope.Channel], true
		}
		if s.stop.Err() != nil {
			return nil, false
		}
		metrics.MemberLookupRetries.Inc()
		if attempt == 1 || attempt%10 == 0 {
			s.log.Warn("member lookup for live delivery failed; delivery waits and retries",
				"id", d.Event.ID, "channel", d.Scope.Channel, "attempt", attempt, "err", err)
		}
		if s.onLookupRetry != nil {
			s.onLookupRetry()
		}
		select {
		case <-s.stop.Done():
			return nil, false
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// deliver enqueues ev on each matching subscription of c, all copies at once (sendQueue.offer):
// the queue admits them as it would admit one. Each subscription stays locked from its de-dup
// check until its copy is queued, as in sendLocked, so nothing goes to one that a CLOSE or a REQ
// of the same id ended meanwhile. c.mu serializes deliveries, so only this goroutine ever holds
// more than one subscription's lock. It returns what the delivery cost (deliveryCost).
func (c *conn) deliver(d live, js []byte, ix tagIndex) (cost int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d.due && c.dueSeenBefore(d) {
		return 1
	}
	cp := liveCopies{d: d, js: js, ix: ix, id: keyOf(d.Event.ID)}
	defer cp.unlock()
	if d.due {
		// I6 (docs/design.md) and docs/protocol.md: no connection receives a due signal twice.
		for _, sub := range c.dueCandidates() {
			if cp.take(sub); len(cp.msgs) > 0 {
				break
			}
		}
	} else {
		for _, sub := range c.subs {
			cp.take(sub)
		}
	}
	cost = deliveryCost(cp.msgs)
	if len(cp.msgs) == 0 {
		return cost
	}
	if why := c.q.offer(cp.msgs...); why != "" {
		c.overflow(why)
		return cost
	}
	if d.due {
		metrics.ReminderDueDelivered.Add(float64(len(cp.msgs)))
	}
	return cost
}

// dueSeenBefore reports whether this connection had d's due signal already, and notes it. A due
// signal re-sends an event the subscription has already seen: it bypasses the id de-dup and is
// de-duplicated per connection by (id, stamp) instead. Caller holds c.mu.
func (c *conn) dueSeenBefore(d live) bool {
	k := dueKey{id: keyOf(d.Event.ID), stamp: d.stamp}
	if c.dueSeen.has(k) {
		return true
	}
	c.dueSeen.add(k)
	return false
}

// dueCandidates orders c's subscriptions for a due signal, which goes to one of them only. "Each
// of the author's live subscriptions whose filter matches it" says where it may go, so a
// connection with several such subscriptions gets it once: on a reminders subscription (a filter
// for kind 30300 alone) if it has one, as a NIP-ER client keeps one beside its broader ones, and
// among equals on the lowest id that takes it (deterministic). Caller holds c.mu.
func (c *conn) dueCandidates() []*subscription {
	ids := make([]string, 0, len(c.subs))
	for sid := range c.subs {
		ids = append(ids, sid)
	}
	slices.SortFunc(ids, func(a, b string) int {
		ra, rb := c.subs[a].remindersOnly(), c.subs[b].remindersOnly()
		if ra != rb {
			if ra {
				return -1
			}
			return 1
		}
		return strings.Compare(a, b)
	})
	subs := make([]*subscription, len(ids))
	for i, sid := range ids {
		subs[i] = c.subs[sid]
	}
	return subs
}

// liveCopies gathers one event's copies for the subscriptions of one connection that take it,
// holding each of those subscriptions locked until unlock.
type liveCopies struct {
	d      live
	js     []byte
	ix     tagIndex
	id     idKey
	locked []*subscription
	msgs   [][]byte
}

// take adds a copy for sub if sub matches the event and has not had it; sub stays locked then.
func (cp *liveCopies) take(sub *subscription) {
	matched, liveOnly := sub.matching(cp.d, cp.ix)
	if !matched {
		return
	}
	sub.mu.Lock()
	// An event the query's snapshot saw was answered or passed over by the filters with a
	// query; one that also matches a filter with limit 0 is new to that filter, unless a
	// row already sent it (at most once per subscription).
	if sub.closed || (sub.answered(cp.d.Delivery) && (!liveOnly || sub.sentAsRow(cp.id, cp.d.Delivery, cp.ix))) || (!cp.d.due && !sub.seen.add(cp.id)) {
		sub.mu.Unlock()
		return
	}
	cp.locked = append(cp.locked, sub)
	if sub.sentLive != nil && !cp.d.due && len(sub.sentLive) < sentLiveMax {
		sub.sentLive[cp.id] = struct{}{}
	}
	cp.msgs = append(cp.msgs, eventMessage(sub.prefix, cp.js))
}

func (cp *liveCopies) unlock() {
	for _, sub := range cp.locked {
		sub.mu.Unlock()
	}
}

// remindersOnly reports whether one of sub's filters asks for reminders (kind 30300) alone: the
// subscription a due signal is meant for when a connection has several that match it.
func (sub *subscription) remindersOnly() bool {
	for _, f := range sub.filters {
		if len(f.kinds) == 1 && f.kinds[0] == kindReminder {
			return true
		}
	}
	return false
}

// anySubscriptionMatches reports whether a subscription of an authenticated connection (only
// they can be members of a DM) matches d, before any read gate. Only the connections the interest
// index names can hold one.
func (s *Server) anySubscriptionMatches(d live, ix tagIndex) bool {
	for _, c := range s.interest.candidates(d.Event) {
		if len(c.authedList()) > 0 && c.anySubMatches(d, ix) {
			return true
		}
	}
	return false
}

// anySubMatches: the unlock is deferred so that a panic in matching (recovered by deliver) cannot
// leave c.mu held, which would stall all live delivery at this connection's next event.
func (c *conn) anySubMatches(d live, ix tagIndex) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, sub := range c.subs {
		if sub.matchesAny(d, ix) {
			return true
		}
	}
	return false
}

// matching reports whether d matches one of s's filters, and whether one of those it matches had
// no initial query (limit 0): for that one d is live whatever the query's snapshot saw.
func (s *subscription) matching(d live, ix tagIndex) (matched, liveOnly bool) {
	for _, f := range s.filters {
		if f.matchesIndexed(d.Event, ix, d.due) {
			matched = true
			if f.limit <= 0 {
				return true, true
			}
		}
	}
	return matched, false
}

// hasQueried reports whether one of the filters has an initial query.
func (s *subscription) hasQueried() bool {
	for _, f := range s.filters {
		if f.limit > 0 {
			return true
		}
	}
	return false
}

// matchesQueried reports whether d matches a filter that had an initial query. Only a stored
// event can be answered by a query, so d is never a due signal.
func (s *subscription) matchesQueried(d evt.Delivery, ix tagIndex) bool {
	for _, f := range s.filters {
		if f.limit > 0 && f.matchesIndexed(d.Event, ix, false) {
			return true
		}
	}
	return false
}

func (s *subscription) matchesAny(d live, ix tagIndex) bool {
	for _, f := range s.filters {
		if f.matchesIndexed(d.Event, ix, d.due) {
			return true
		}
	}
	return false
}

// settleSoon checks the pending forgets against a fresh snapshot off the delivery goroutine, one
// check at a time; forgets announced while one runs get one more. The check only tidies: a
// lookup checks every pending forget itself before it trusts what it read. Run inline, it made
// live delivery to everyone wait up to memberWait per announced edit whenever the lookup pool
// could not answer (a bulk member edit then stalled fan-out for minutes).
func (s *Server) settleSoon() {
	s.settleMu.Lock()
	defer s.settleMu.Unlock()
	if s.settleStopped {
		return
	}
	if s.settleRun != nil {
		s.settleAgain = true
		return
	}
	run := make(chan struct{})
	s.settleRun = run
	go func() {
		defer close(run)
		for {
			ctx, cancel := context.WithTimeout(s.stop, s.memberWait)
			if err := s.members.settle(ctx, s.lookup); err != nil && s.stop.Err() == nil {
				s.log.Debug("checking announced member edits failed; the next lookup checks them", "err", err)
			}
			cancel()
			s.settleMu.Lock()
			if !s.settleAgain || s.stop.Err() != nil {
				s.settleRun = nil
				s.settleMu.Unlock()
				if s.onSettled != nil {
					s.onSettled()
				}
				return
			}
			s.settleAgain = false
			s.settleMu.Unlock()
		}
	}()
}

// stopSettling starts no more checks and returns what closes when the running one (if any) has
// returned; s.stop has ended by then, so it returns at once.
func (s *Server) stopSettling() <-chan struct{} {
	s.settleMu.Lock()
	defer s.settleMu.Unlock()
	s.settleStopped = true
	if s.settleRun == nil {
		done := make(chan struct{})
		close(done)
		return done
	}
	return s.settleRun
}
