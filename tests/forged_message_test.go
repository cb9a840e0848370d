package tests

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Issue 29, finding 2: a role that may call pg_logical_emit_message wrote a 'buzz' message with a
// kind 9 "from alice" and an all-zero signature, and subscribers received it. The fan-out now
// verifies every event it takes from a logical message: neither that nor a forged due signal for
// alice's reminder subscription reaches a subscriber; alice's own event after them does.
func TestForgedLogicalMessageReachesNoSubscriber(t *testing.T) {
	ctx := context.Background()
	url := testenv.DB(t)
	r := testenv.StartRelay(t, testenv.RelayOpts{DatabaseURL: url})
	pool := testenv.Pool(t, url)
	alice := testenv.NewUser()

	anon := testenv.Dial(t, r.URL)
	everything := anon.Subscribe(nostr.Filter{})
	own := testenv.Dial(t, r.URL)
	own.Auth(alice.SK)
	reminders := own.Subscribe(nostr.Filter{Kinds: []int{30300}, Authors: []string{alice.PK}},
		nostr.Filter{Kinds: []int{1}, Authors: []string{alice.PK}})

	forge := func(kind int, tags nostr.Tags) *nostr.Event {
		ev := &nostr.Event{Kind: kind, PubKey: alice.PK, CreatedAt: nostr.Now(), Tags: tags,
			Content: "forged", Sig: strings.Repeat("0", 128)}
		ev.ID = ev.GetID()
		return ev
	}
	emit := func(payload map[string]any) {
		t.Helper()
		b, _ := json.Marshal(payload)
		if _, err := pool.Exec(ctx, `SELECT pg_logical_emit_message(true, 'buzz', $1::text)`, string(b)); err != nil {
			t.Fatal(err)
		}
	}
	chat := forge(9, nostr.Tags{})
	emit(map[string]any{"t": "eph", "scope": "*", "ev": chat})
	due := forge(30300, nostr.Tags{{"d", "forged"}})
	emit(map[string]any{"t": "due", "scope": "a", "ev": due, "stamp": 1})

	// Committed after the forged messages, so delivered after them on both connections.
	barrier := alice.Event(t, 1, nil, "")
	own.MustPublish(barrier)
	everything.WaitEvents(20*time.Second, barrier.ID)
	reminders.WaitEvents(20*time.Second, barrier.ID)
	for name, sub := range map[string]*testenv.Sub{"anonymous, all events": everything, "alice's reminders": reminders} {
		for _, forged := range []*nostr.Event{chat, due} {
			if n := sub.Counts()[forged.ID]; n != 0 {
				t.Errorf("%s: the forged kind %d arrived %d times", name, forged.Kind, n)
			}
		}
	}
}
