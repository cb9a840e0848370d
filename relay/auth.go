package relay

import (
	"net/url"
	"slices"
	"strings"
	"unicode"

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

// sameRelayURL reports whether theirs, the relay tag of an AUTH event, names ours, the relay URL
// this process serves. Scheme, host, port and path must be the same after the normalisation
// NIP-42 allows: case of scheme and host, a default port written out or left out, one trailing
// slash. Anything else makes it another URL, one a client did not connect to: a query, a
// fragment, userinfo, whitespace. ours is the operator's value, trimmed as config reads it.
func sameRelayURL(theirs, ours string) bool {
	a, ok := relayURLParts(theirs)
	if !ok {
		return false
	}
	b, ok := relayURLParts(strings.TrimSpace(ours))
	return ok && a == b
}

// relayURLParts normalises a ws:// or wss:// URL to what names a relay; ok is false for anything
// that is not one plainly.
func relayURLParts(raw string) (parts [4]string, ok bool) {
	if strings.ContainsAny(raw, "?#") || strings.ContainsFunc(raw, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) {
		return parts, false
	}
	u, err := url.Parse(raw)
	if err != nil || u.Opaque != "" || u.User != nil || u.Host == "" {
		return parts, false
	}
	scheme := strings.ToLower(u.Scheme)
	port := u.Port()
	switch {
	case scheme == "ws" && port == "":
		port = "80"
	case scheme == "wss" && port == "":
		port = "443"
	case scheme != "ws" && scheme != "wss":
		return parts, false
	}
	path := u.EscapedPath()
	path = strings.TrimSuffix(path, "/")
	return [4]string{scheme, strings.ToLower(u.Hostname()), port, path}, true
}
