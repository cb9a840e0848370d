package upkeep_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A rule covering every kind leaves a DM's state alone: its channel, member and visibility rows,
// and the events that opened and hid it. Its messages go.
func TestUpkeepKeepsDMState(t *testing.T) {
	_, pool, u := setup(t)
	a, b := testenv.NewUser(), testenv.NewUser()
	at := nostr.Timestamp(time.Now().Unix() - 1000)
	open := a.EventAt(t, 41010, nostr.Tags{{"p", b.PK}}, "", at)
	ok, msg := accept(t, pool, open)
	if !ok || !strings.HasPrefix(msg, "response:") {
		t.Fatalf("open DM: %v %q", ok, msg)
	}
	var resp struct {
		ChannelID string `json:"channel_id"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp); err != nil {
		t.Fatal(err)
	}
	chat := a.EventAt(t, 9, nostr.Tags{{"h", resp.ChannelID}}, "hello", at+1)
	hide := b.EventAt(t, 41012, nostr.Tags{{"h", resp.ChannelID}}, "", at+2)
	for _, ev := range []*nostr.Event{chat, hide} {
		if ok, msg := accept(t, pool, ev); !ok {
			t.Fatalf("accept kind %d: %s", ev.Kind, msg)
		}
	}
	state := func() string {
		return testenv.MustScalar[string](t, pool, `SELECT concat_ws(' | ',
			(SELECT string_agg(id::text || created_by, ',') FROM buzz.channels),
			(SELECT string_agg(pubkey || coalesce(hidden_at::text, '-'), ',' ORDER BY pubkey) FROM buzz.members),
			(SELECT string_agg(viewer || target_generation, ',' ORDER BY viewer) FROM buzz.visibility_state))`)
	}
	before := state()
	rule(t, pool, `INSERT INTO buzz.retention (name, kind_min, kind_max, max_age) VALUES ('everything', 0, 65535, '1 minute')`)

	mustLead(t, u)
	if stored(t, pool, chat.ID) {
		t.Fatal("the rule removed nothing (the DM message is still stored): the test proves nothing")
	}
	for name, id := range map[string]string{"DM open (41010)": open.ID, "DM hide (41012)": hide.ID} {
		if !stored(t, pool, id) {
			t.Errorf("%s event was purged", name)
		}
	}
	if after := state(); after != before {
		t.Errorf("DM state changed:\nbefore %s\nafter  %s", before, after)
	}
}

// Reminder versions: an expired 30300 whose reminder is still armed stays (delivery reads the
// event), one whose reminder is settled goes; a retention rule never removes a 30300 (a removed
// delivered version could be stored and armed again, and fire twice).
func TestUpkeepKeepsLiveReminderVersions(t *testing.T) {
	_, pool, u := setup(t)
	now := time.Now().Unix()
	pk := hex64()
	version := func(d, state string) string {
		id := insert(t, pool, row{kind: 30300, pubkey: pk, created: now - 1000, d: &d, expires: ptr(now - 1000)})
		if _, err := pool.Exec(context.Background(), `INSERT INTO buzz.reminders (id, pubkey, d_tag, created_at, not_before, expires_at, state, cancelled_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $7 = 'cancelled' THEN now() END)`, id, pk, d, now-1000, now-2000, now-1000, state); err != nil {
			t.Fatal(err)
		}
		return id
	}
	armed := version("a", "armed")
	settled := version("b", "cancelled")
	plain := insert(t, pool, row{kind: 30300, pubkey: pk, created: now - 1000, d: ptr("c")})

	mustLead(t, u)
	if !stored(t, pool, armed) {
		t.Error("an expired 30300 whose reminder is armed was purged")
	}
	if stored(t, pool, settled) {
		t.Error("an expired 30300 whose reminder is settled is still stored")
	}
	rule(t, pool, `INSERT INTO buzz.retention (name, kinds, max_age) VALUES ('reminders', '{30300}', '1 minute')`)
	mustLead(t, u)
	if !stored(t, pool, plain) {
		t.Error("a retention rule removed a 30300 version")
	}
}
