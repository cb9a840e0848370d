package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Helpers of the multi-process fan-out tests (prefix fan); the WebSocket client is testenv.Client.

type fanUser struct{ sk, pk string }

func newFanUser() fanUser { sk, pk := testenv.NewKey(); return fanUser{sk, pk} }

var fanNonce atomic.Int64

// event signs a new event; a nonce tag keeps events distinct within one second.
func (u fanUser) event(kind int, content string, tags ...nostr.Tag) *nostr.Event {
	all := append(nostr.Tags{}, tags...)
	all = append(all, nostr.Tag{"nonce", fmt.Sprint(fanNonce.Add(1))})
	ev := &nostr.Event{Kind: kind, CreatedAt: nostr.Now(), Tags: all, Content: content}
	if err := ev.Sign(u.sk); err != nil {
		panic(err)
	}
	return ev
}

// eventAt signs a new event created at at, with exactly these tags (no nonce: the created_at
// tells versions apart).
func (u fanUser) eventAt(t testing.TB, kind int, at nostr.Timestamp, tags ...nostr.Tag) *nostr.Event {
	t.Helper()
	ev := &nostr.Event{Kind: kind, CreatedAt: at, Tags: append(nostr.Tags{}, tags...), Content: "v"}
	if err := ev.Sign(u.sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// fanPsqlAccept stores ev the way an operator does from psql.
func fanPsqlAccept(t testing.TB, dbURL string, ev *nostr.Event) {
	t.Helper()
	b, _ := json.Marshal(ev)
	pool := testenv.Pool(t, dbURL)
	var ok bool
	var msg string
	if err := pool.QueryRow(context.Background(), `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(b)).Scan(&ok, &msg); err != nil || !ok {
		t.Fatalf("accept_event from SQL: %v %v %q", err, ok, msg)
	}
}

// fanOpenDM opens (or finds) the DM of u and with over c, on which u is authenticated, and
// returns its channel id.
func fanOpenDM(t testing.TB, c *testenv.Client, u fanUser, with string) string {
	t.Helper()
	msg := c.MustPublish(u.event(41010, "", nostr.Tag{"p", with}))
	return testenv.DMChannelID(t, msg)
}
