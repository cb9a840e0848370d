package fanout

import (
	"github.com/nbd-wtf/go-nostr"
)

// A 'buzz' logical message proves nothing about who wrote it: any role that may call
// pg_logical_emit_message can emit one. A stored row came through accept_event, whose caller
// verified the event; an event in a message is checked here before it goes anywhere. An
// ephemeral event is signed by its author, and a due signal carries the stored reminder, signed
// by its author too, so both are checked the same way. A genuine event replayed in a forged
// message still passes: only the grant of pg_logical_emit_message keeps roles from emitting.

// Why a message, or an event in one, was ignored (buzz_fanout_messages_rejected_total).
const (
	rejectMalformed = "malformed"     // not a message of a known shape, or an event field of the wrong form
	rejectBadID     = "bad_id"        // the id does not hash the event
	rejectBadSig    = "bad_signature" // the signature does not verify
)

// rejection says why ev must not be delivered, "" when it may. Cheap checks run first; CheckID
// would panic on a short id.
func rejection(ev *nostr.Event) string {
	switch {
	case !isHex(ev.ID, 64), !isHex(ev.PubKey, 64), !isHex(ev.Sig, 128):
		return rejectMalformed
	case !ev.CheckID():
		return rejectBadID
	}
	if ok, _ := ev.CheckSignature(); !ok {
		return rejectBadSig
	}
	return ""
}

// isHex reports whether s is n lowercase hex digits.
func isHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
