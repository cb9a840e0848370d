package relay

import (
	"context"
	"slices"

	"github.com/buzzpg/buzzpg/internal/evt"
)

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
