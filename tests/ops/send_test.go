package ops

import (
	"context"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// `buzzpg send` signs a kind 9 with the relay key on a member's behalf; it is stored through
// accept_event and resurfaces the DM for the other participants, with the actor as sender.
func TestSendPostsRelaySignedMessage(t *testing.T) {
	url := testenv.DB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	relaySK, relayPK := testenv.NewKey()
	if _, err := pool.Exec(ctx, `UPDATE buzz.config SET value=$1 WHERE key='relay_pubkey'`, relayPK); err != nil {
		t.Fatal(err)
	}
	a, b := testenv.NewUser(), testenv.NewUser()
	ok, msg, err := store.Accept(ctx, pool, a.Event(t, 41010, nostr.Tags{{"p", b.PK}}, ""))
	if err != nil || !ok {
		t.Fatalf("open: %v %q %v", ok, msg, err)
	}
	var ch string
	if err := pool.QueryRow(ctx, `SELECT channel_id::text FROM buzz.members WHERE pubkey=$1`, a.PK).Scan(&ch); err != nil {
		t.Fatal(err)
	}
	for _, u := range []testenv.User{a, b} {
		if ok, msg, err := store.Accept(ctx, pool, u.Event(t, 41012, nostr.Tags{{"h", ch}}, "")); err != nil || !ok {
			t.Fatalf("hide: %v %q %v", ok, msg, err)
		}
	}
	env := []string{"DATABASE_URL=" + url, "BUZZ_RELAY_KEY=" + relaySK}
	out, code := runBinary(t, env, "send", "--channel", ch, "--as", a.PK, "deploy finished")
	if code != 0 {
		t.Fatalf("send: exit %d: %s", code, out)
	}
	var pubkey, content string
	var tags []string
	if err := pool.QueryRow(ctx, `SELECT pubkey, content, ARRAY(SELECT jsonb_array_elements(tags)::text) FROM buzz.events WHERE kind=9 AND h=$1`, ch).Scan(&pubkey, &content, &tags); err != nil {
		t.Fatal(err)
	}
	if pubkey != relayPK || content != "deploy finished" || !strings.Contains(strings.Join(tags, ","), a.PK) {
		t.Fatalf("stored %s %q %v", pubkey, content, tags)
	}
	var aHidden, bHidden bool
	_ = pool.QueryRow(ctx, `SELECT bool_or(hidden_at IS NOT NULL) FILTER (WHERE pubkey=$1), bool_or(hidden_at IS NOT NULL) FILTER (WHERE pubkey=$2) FROM buzz.members WHERE channel_id=$3`, a.PK, b.PK, ch).Scan(&aHidden, &bHidden)
	if bHidden || !aHidden {
		t.Fatalf("after send: actor hidden %v (want true), other hidden %v (want false)", aHidden, bHidden)
	}
	// A non-member actor is refused with the prefixed reason, and nothing is stored.
	out, code = runBinary(t, env, "send", "--channel", ch, "--as", testenv.NewUser().PK, "intruder")
	if code == 0 || !strings.Contains(out, "restricted:") {
		t.Fatalf("non-member actor: exit %d: %s", code, out)
	}
}
