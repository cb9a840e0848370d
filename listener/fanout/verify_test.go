package fanout

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// forged returns ev with its id recomputed after the change and a signature of zeros, as a role
// that may call pg_logical_emit_message can write it (issue 29, finding 2).
func forged(kind int, pubkey, content string, tags nostr.Tags) *nostr.Event {
	ev := &nostr.Event{Kind: kind, PubKey: pubkey, Content: content, Tags: append(nostr.Tags{}, tags...),
		CreatedAt: nostr.Now(), Sig: strings.Repeat("0", 128)}
	ev.ID = ev.GetID()
	return ev
}

// A 'buzz' logical message proves nothing about who wrote it: an event in one whose signature or
// id does not hold, and a message that does not decode, are ignored and counted. The genuine
// events around them still arrive.
func TestFanoutIgnoresForgedMessages(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	sink := newRecSink()
	h.start(Config{}, sink, nil)
	before := testenv.CounterTotal(t, "buzz_fanout_messages_rejected_total")

	alice := signedEvent(1, "alice's key", nil).PubKey
	eph := forged(9, alice, "from alice", nil)
	h.emit(ctx, map[string]any{"t": "eph", "scope": "*", "ev": eph})
	due := forged(30300, alice, "enc", nostr.Tags{{"d", "r1"}})
	h.emit(ctx, map[string]any{"t": "due", "ev": due, "stamp": 1, "scope": "a"})
	badID := signedEvent(20001, "typing", nil)
	badID.Content = "changed after signing"
	genuine := signedEvent(30300, "enc", nostr.Tags{{"d", "r2"}})
	h.emit(ctx, map[string]any{"t": "dues", "scope": "a", "items": []map[string]any{
		{"ev": badID, "stamp": 2}, {"ev": genuine, "stamp": 3}}})
	if _, err := h.pool.Exec(ctx, `SELECT pg_logical_emit_message(true, 'buzz', '{"t":"eph","ev":')`); err != nil {
		t.Fatal(err)
	}
	short := forged(20001, "abc", "short pubkey", nil)
	h.emit(ctx, map[string]any{"t": "eph", "scope": "*", "ev": short})

	barrier := signedEvent(1, "barrier", nil)
	h.accept(ctx, barrier) // committed after all of the above: delivered after them
	sink.waitAll(t, []string{barrier.ID, genuine.ID + "/3"}, 20*time.Second)
	for _, ev := range []*nostr.Event{eph, due, badID, short} {
		for _, key := range []string{ev.ID, ev.ID + "/1", ev.ID + "/2"} {
			if n := sink.count(key); n != 0 {
				t.Errorf("forged %s (kind %d) delivered %d times", key, ev.Kind, n)
			}
		}
	}
	// eph and due: bad_signature; badID: bad_id; the cut message and short: malformed.
	if got := testenv.CounterTotal(t, "buzz_fanout_messages_rejected_total") - before; got != 5 {
		t.Errorf("buzz_fanout_messages_rejected_total grew by %v, want 5", got)
	}
}
