package tests

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A DM open (41010) names 1-8 other participants (docs/protocol.md, Channels and DMs): counted as open_dm sees them,
// distinct and without the author (sql/0002_accept.up.sql). Raw p tags were counted, so the author's own key or
// a key named twice on top of 8 others was refused though the DM has 9 participants.
func TestDMOpenCountsDistinctOthers(t *testing.T) {
	url := testenv.DB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	a := testenv.NewUser()
	var others nostr.Tags
	for i := 0; i < 8; i++ {
		others = append(others, nostr.Tag{"p", testenv.NewUser().PK})
	}
	open := func(tags ...nostr.Tag) (bool, string) {
		t.Helper()
		ok, msg, err := store.Accept(ctx, pool, a.Event(t, 41010, tags, ""))
		if err != nil {
			t.Fatalf("accept: %v", err)
		}
		return ok, msg
	}
	channel := func(what, msg string) (id string, created bool) {
		t.Helper()
		var r struct {
			ChannelID string `json:"channel_id"`
			Created   bool   `json:"created"`
		}
		body, isResponse := strings.CutPrefix(msg, "response:")
		if !isResponse || json.Unmarshal([]byte(body), &r) != nil || r.ChannelID == "" {
			t.Fatalf("%s: reply %q, want response:{channel_id, created}", what, msg)
		}
		return r.ChannelID, r.Created
	}
	const refused = "invalid: a DM open names 1 to 8 other participants"

	// 8 others and the author's own key: 9 participants.
	ok, msg := open(append(append(nostr.Tags{}, others...), nostr.Tag{"p", a.PK})...)
	if !ok {
		t.Fatalf("8 others plus the author's own key: refused %q", msg)
	}
	ch, created := channel("8 others plus the author", msg)
	if !created {
		t.Fatalf("8 others plus the author: created=false for a new set")
	}
	var members int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM buzz.members WHERE channel_id = $1`, ch).Scan(&members); err != nil || members != 9 {
		t.Fatalf("members of the DM: %d (%v), want 9", members, err)
	}

	// The same 8 others with one named twice: the same DM.
	ok, msg = open(append(append(nostr.Tags{}, others...), others[3])...)
	if !ok {
		t.Fatalf("8 others, one named twice: refused %q", msg)
	}
	if again, created := channel("8 others, one twice", msg); again != ch || created {
		t.Fatalf("8 others, one twice: channel %s created=%v, want the existing %s", again, created, ch)
	}

	// Nobody but the author, once or twice: refused.
	for _, tags := range []nostr.Tags{{{"p", a.PK}}, {{"p", a.PK}, {"p", a.PK}}} {
		if ok, msg := open(tags...); ok || msg != refused {
			t.Fatalf("only the author (%d p tags): ok=%v %q, want %q", len(tags), ok, msg, refused)
		}
	}
	// 9 distinct others (the author among the p tags or not): refused.
	ninth := nostr.Tag{"p", testenv.NewUser().PK}
	for _, tags := range []nostr.Tags{
		append(append(nostr.Tags{}, others...), ninth),
		append(append(nostr.Tags{}, others...), ninth, nostr.Tag{"p", a.PK}),
	} {
		if ok, msg := open(tags...); ok || msg != refused {
			t.Fatalf("9 others (%d p tags): ok=%v %q, want %q", len(tags), ok, msg, refused)
		}
	}
}
