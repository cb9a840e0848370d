package relay

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/metrics"
)

const (
	kindSnapshot = 30622 // NIP-DV visibility snapshot: relay-signed only
	kindGiftWrap = 1059  // NIP-59: served to its one recipient only (Read gates)
	kindReminder = 30300 // NIP-ER: author-only; sent again when due
)

// handleEvent answers one EVENT with exactly one OK: Go checks first (shape, id, signature,
// limits), in the read loop and in order, then the one SQL call whose verdict goes back verbatim,
// made by the connection's pipeline (pipeline.go) while the read loop reads on. size is the
// frame's length, what the event holds in the window. Live delivery is not done here: it comes
// through Deliver from the replication tail, for this process and all others.
func (c *conn) handleEvent(ev *nostr.Event, size int) {
	if !c.allowEvent("EVENT") {
		c.queueDecided(ev.ID, false, "rate-limited: slow down, too many events")
		return
	}
	if reason := c.s.checkEvent(ev, c.authedList(), timeNow()); reason != "" {
		c.queueDecided(ev.ID, false, reason)
		return
	}
	if isEphemeral(ev.Kind) {
		if c.pipe.holds(ev.ID) {
			c.waitEvents() // the same ephemeral event in flight: its verdict decides this one's
		}
		if c.s.ephemeral.seen(keyOf(ev.ID), timeNow()) {
			c.queueDecided(ev.ID, true, "duplicate: already have this event")
			return
		}
	}
	c.queueAccept(ev, size)
}

// okPrefixes are the machine-readable OK prefixes (docs/protocol.md), the metric's label values.
var okPrefixes = []string{"duplicate", "invalid", "blocked", "rate-limited", "restricted", "auth-required", "error"}

// replyEvent sends an EVENT's OK and counts its verdict by prefix.
func (c *conn) replyEvent(id string, ok bool, msg string) {
	verdict := "accepted"
	if !ok {
		verdict = "error"
	}
	if i := strings.IndexByte(msg, ':'); i > 0 && slices.Contains(okPrefixes, msg[:i]) {
		verdict = msg[:i]
	}
	metrics.EventsAccepted.WithLabelValues(verdict).Inc()
	c.sendOK(id, ok, msg)
}

// acceptEvent stores the event through the batcher (internal/store/batch.go): alone when the
// relay is idle, with the events that arrived meanwhile when it is busy, each with the verdict
// buzz.accept_event gives it. Client errors come back as a verdict; err is only for failures
// that are not the client's.
func (s *Server) acceptEvent(ctx context.Context, ev *nostr.Event) (bool, string, error) {
	ctx, cancel := context.WithTimeout(ctx, acceptTimeout)
	defer cancel()
	start := time.Now()
	ok, msg, err := s.batcher.Accept(ctx, eventJSON(ev), channelOf(ev))
	metrics.AcceptSeconds.Observe(time.Since(start).Seconds())
	return ok, msg, err
}

// channelOf is the channel an event names (its first h tag), "" for none: the lock order of a
// batched acceptance (store.Batcher.Accept).
func channelOf(ev *nostr.Event) string {
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == "h" {
			return t[1]
		}
	}
	return ""
}

// setBased guesses whether accept_events stores ev set-based (buzz.plain_events, sql/0002_accept):
// a regular kind without side effects, no h tag, no expiration tag and no empty tag. It errs only
// towards false, so calls sized by it keep their subtransactions within bounds
// (store.Group.Special). The relay already refused a created_at too far ahead.
func setBased(ev *nostr.Event) bool {
	switch k := ev.Kind; {
	case k == 0, k == 3, k == 5, k == 1059, k >= 41010 && k <= 41012, k >= 10000 && k < 40000:
		return false
	}
	for _, t := range ev.Tags {
		if len(t) == 0 || t[0] == "h" || t[0] == "expiration" {
			return false
		}
	}
	return true
}

// checkShapeAndSignature checks what every signed event needs: hex fields of the right length,
// a kind in range, the id hashing the content (CheckSignature does not look at the id) and the
// signature. Cheap checks run first; CheckID would panic on a short id.
func checkShapeAndSignature(ev *nostr.Event) string {
	switch {
	case !isHex(ev.ID, 64):
		return "invalid: id must be 64-character lowercase hex"
	case !isHex(ev.PubKey, 64):
		return "invalid: pubkey must be 64-character lowercase hex"
	case !isHex(ev.Sig, 128):
		return "invalid: sig must be 128-character lowercase hex"
	case ev.Kind < 0 || ev.Kind > 65535:
		return "invalid: kind must be between 0 and 65535"
	case ev.CreatedAt < 0:
		return "invalid: created_at must not be negative"
	}
	if strings.IndexByte(ev.Content, 0) >= 0 {
		return "invalid: content contains a NUL character"
	}
	for _, t := range ev.Tags {
		for _, v := range t {
			if strings.IndexByte(v, 0) >= 0 {
				return "invalid: tags contain a NUL character"
			}
		}
	}
	if !ev.CheckID() {
		return "invalid: id does not match the event"
	}
	if !verifySignature(ev) {
		return "invalid: bad signature"
	}
	return ""
}

// checkEvent is everything Go decides about an EVENT before SQL; "" means call accept_event.
func (s *Server) checkEvent(ev *nostr.Event, authed []string, now time.Time) string {
	// Limits first: they are cheaper than hashing and verifying. NIP-11 counts content in
	// unicode characters; the byte length bounds that count, so most events skip the rune scan.
	if len(ev.Content) > s.cfg.MaxContentLength && utf8.RuneCountInString(ev.Content) > s.cfg.MaxContentLength {
		return fmt.Sprintf("invalid: content longer than %d characters", s.cfg.MaxContentLength)
	}
	if len(ev.Tags) > s.cfg.MaxEventTags {
		return fmt.Sprintf("invalid: more than %d tags", s.cfg.MaxEventTags)
	}
	if ev.Kind == nostr.KindDeletion {
		if n := deletionTargets(ev); n > maxDeletionTargets {
			return fmt.Sprintf("invalid: a deletion names at most %d events or addresses (this one names %d); send several", maxDeletionTargets, n)
		}
	}
	if reason := checkShapeAndSignature(ev); reason != "" {
		return reason
	}
	switch ev.Kind {
	case nostr.KindClientAuthentication:
		return "invalid: kind 22242 is for AUTH, not EVENT"
	case kindSnapshot:
		return "restricted: relay-only kind"
	case kindGiftWrap:
		if recipients(ev) > 1 {
			return "invalid: a gift wrap names one recipient (p tag); send one wrap per recipient"
		}
		// The channel's members and the recipient would both have a claim to read it (sql/0002_accept.up.sql).
		if slices.ContainsFunc(ev.Tags, func(t nostr.Tag) bool { return len(t) >= 2 && t[0] == "h" }) {
			return "invalid: a gift wrap names no channel (h tag); it is read by its recipient (p tag) only"
		}
	}
	if int64(ev.CreatedAt) > now.Unix()+s.cfg.MaxFutureSeconds {
		return "invalid: created_at too far in future"
	}
	if isProtected(ev) && !slices.Contains(authed, ev.PubKey) {
		// NIP-42: auth-required only when no key is authenticated; restricted when one is but it
		// is not the author (docs/protocol.md words the read gates the same way).
		if len(authed) == 0 {
			return "auth-required: this event is protected (NIP-70); AUTH as its author to publish it"
		}
		return "restricted: this event is protected (NIP-70); only its author may publish it"
	}
	return ""
}

// deletionTargets counts the e and a tags of a kind 5: its acceptance (accept_event for the ids,
// apply_deletion for the addresses) holds one advisory lock per target until commit, in PostgreSQL's shared lock table, so an unbounded request (2,000 tags fit a
// frame) lets a few clients fill that table and fail every other transaction.
func deletionTargets(ev *nostr.Event) int {
	n := 0
	for _, t := range ev.Tags {
		if len(t) >= 2 && (t[0] == "e" || t[0] == "a") {
			n++
		}
	}
	return n
}

// recipients counts the distinct values of ev's p tags. A gift wrap is read by the pubkey in its
// p tag (docs/protocol.md): accept_event gates it on the first, and the closing rule (gateClosure)
// judges a filter by its #p values. With a second recipient the two would disagree: a filter on
// the second's key, sent by the first, matches a wrap its sender may read, yet is closed. NIP-59
// wraps once per recipient, so a wrap naming more than one is refused. accept_event refuses it
// too, in the same words, for psql callers; one without a p tag only accept_event refuses.
func recipients(ev *nostr.Event) int {
	first, n := "", 0
	for _, t := range ev.Tags {
		if len(t) < 2 || t[0] != "p" {
			continue
		}
		switch {
		case n == 0:
			first, n = t[1], 1
		case t[1] != first:
			return 2
		}
	}
	return n
}

// isProtected reports a NIP-70 ["-"] tag.
func isProtected(ev *nostr.Event) bool {
	for _, t := range ev.Tags {
		if len(t) >= 1 && t[0] == "-" {
			return true
		}
	}
	return false
}
