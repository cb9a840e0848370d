package relay

import (
	"net/url"
	"slices"
	"strings"

	"github.com/nbd-wtf/go-nostr"
)

// handleAuth checks a NIP-42 kind 22242 event and, when valid, adds its pubkey to the
// connection's authenticated set. The event is never stored or broadcast.
func (c *conn) handleAuth(ev *nostr.Event) {
	if !c.allowEvent("AUTH") {
		c.sendOK(ev.ID, false, "rate-limited: slow down, too many events")
		return
	}
	if reason := c.checkAuthEvent(ev); reason != "" {
		c.sendOK(ev.ID, false, reason)
		return
	}
	for {
		cur := c.authed.Load()
		if slices.Contains(*cur, ev.PubKey) {
			break
		}
		if len(*cur) >= maxAuthPubkeys {
			c.sendOK(ev.ID, false, "restricted: too many authenticated pubkeys on one connection")
			return
		}
		next := append(slices.Clone(*cur), ev.PubKey)
		if c.authed.CompareAndSwap(cur, &next) {
			break
		}
	}
	// Before the OK: a REQ the client sends after it must find this connection in the index.
	c.s.indexAuth(c, ev.PubKey)
	c.log.Debug("authenticated", "pubkey", ev.PubKey)
	c.sendOK(ev.ID, true, "")
}

// The cheap checks come first: a replayed or foreign AUTH costs no signature verification.
func (c *conn) checkAuthEvent(ev *nostr.Event) string {
	if ev.Kind != nostr.KindClientAuthentication {
		return "invalid: AUTH needs a kind 22242 event"
	}
	challenge := ev.Tags.GetFirst([]string{"challenge", ""})
	if challenge == nil || len(*challenge) < 2 || (*challenge)[1] != c.challenge {
		return "invalid: challenge does not match"
	}
	relay := ev.Tags.GetFirst([]string{"relay", ""})
	if relay == nil || len(*relay) < 2 || c.relayURL == "" || !sameRelayURL((*relay)[1], c.relayURL) {
		return "invalid: relay URL does not match"
	}
	now := timeNow()
	t := ev.CreatedAt.Time()
	if t.Before(now.Add(-authWindow)) || t.After(now.Add(authWindow)) {
		return "invalid: created_at must be within 10 minutes of now"
	}
	return checkShapeAndSignature(ev)
}

// sameRelayURL compares relay URLs the way clients write them: case-insensitive scheme and host,
// default ports implied, trailing slash ignored.
func sameRelayURL(a, b string) bool {
	ua, err1 := url.Parse(strings.TrimSpace(a))
	ub, err2 := url.Parse(strings.TrimSpace(b))
	if err1 != nil || err2 != nil {
		return false
	}
	norm := func(u *url.URL) string {
		host := strings.ToLower(u.Host)
		scheme := strings.ToLower(u.Scheme)
		if scheme == "ws" {
			host = strings.TrimSuffix(host, ":80")
		} else if scheme == "wss" {
			host = strings.TrimSuffix(host, ":443")
		}
		return scheme + "://" + host + strings.TrimRight(u.Path, "/")
	}
	return norm(ua) == norm(ub)
}
