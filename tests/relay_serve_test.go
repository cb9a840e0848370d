package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Black-box tests of the relay through a real `buzzpg serve`: what a client sees on the wire,
// with live delivery coming through the process's replication tail.

// rbDial connects and checks that the relay opens with its NIP-42 AUTH challenge.
func rbDial(t testing.TB, url string) *testenv.Client {
	t.Helper()
	c := testenv.Dial(t, url)
	if v := c.FirstVerb(); v != "AUTH" {
		t.Fatalf("first message %s, want AUTH", v)
	}
	return c
}

func rbSign(sk string, kind int, content string, at nostr.Timestamp, tags ...nostr.Tag) *nostr.Event {
	ev := &nostr.Event{Kind: kind, Content: content, CreatedAt: at, Tags: nostr.Tags(tags)}
	if ev.Tags == nil {
		ev.Tags = nostr.Tags{}
	}
	_ = ev.Sign(sk)
	return ev
}

func TestRelayServeEndToEnd(t *testing.T) {
	relayKey, relayPub := testenv.NewKey()
	r := testenv.StartRelay(t, testenv.RelayOpts{RelayKey: relayKey})

	t.Run("NIP-11", func(t *testing.T) {
		req, _ := http.NewRequest("GET", r.HTTPURL+"/", nil)
		req.Header.Set("Accept", "application/nostr+json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		var doc struct {
			Pubkey     string         `json:"pubkey"`
			Extensions []string       `json:"supported_extensions"`
			Limitation map[string]any `json:"limitation"`
		}
		if err := json.Unmarshal(body, &doc); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		if doc.Pubkey != relayPub || len(doc.Extensions) != 2 || doc.Limitation["send_queue_bytes"] == nil {
			t.Fatalf("NIP-11: %s", body)
		}
	})

	t.Run("publish on one connection, live on another", func(t *testing.T) {
		sk, pk := testenv.NewKey()
		sub := rbDial(t, r.URL)
		live := sub.Req(nostr.Filter{Authors: []string{pk}})
		if closed, reason := live.Closed(); closed || len(live.Events()) != 0 {
			t.Fatalf("initial: %d %v %q", len(live.Events()), closed, reason)
		}
		pub := rbDial(t, r.URL)
		ev := rbSign(sk, 1, "hello", nostr.Now())
		if r := pub.Publish(ev); !r.OK || r.Msg != "" {
			t.Fatalf("OK %v %q", r.OK, r.Msg)
		}
		if got := live.WaitN(1, 20*time.Second)[0]; got.ID != ev.ID {
			t.Fatalf("live got %s", got.ID)
		}
		if r := pub.Publish(ev); !r.OK || !strings.HasPrefix(r.Msg, "duplicate:") {
			t.Fatalf("duplicate: %v %q", r.OK, r.Msg)
		}
	})

	t.Run("replaceable, deletion, expiration", func(t *testing.T) {
		sk, pk := testenv.NewKey()
		c := rbDial(t, r.URL)
		now := nostr.Now()
		newer := rbSign(sk, 0, `{"name":"new"}`, now)
		older := rbSign(sk, 0, `{"name":"old"}`, now-10)
		if r := c.Publish(newer); !r.OK {
			t.Fatal(r.Msg)
		}
		if r := c.Publish(older); r.OK || !strings.HasPrefix(r.Msg, "duplicate: have newer") {
			t.Fatalf("older replaceable: %v %q", r.OK, r.Msg)
		}
		got := c.Req(nostr.Filter{Authors: []string{pk}, Kinds: []int{0}}).Events()
		if len(got) != 1 || got[0].ID != newer.ID {
			t.Fatalf("kind 0 head: %v", got)
		}
		note := rbSign(sk, 1, "to delete", now)
		c.MustPublish(note)
		del := rbSign(sk, 5, "", now, nostr.Tag{"e", note.ID})
		if r := c.Publish(del); !r.OK {
			t.Fatal(r.Msg)
		}
		if got := c.Req(nostr.Filter{IDs: []string{note.ID}}).Events(); len(got) != 0 {
			t.Fatal("deleted event still served")
		}
		if r := c.Publish(note); r.OK || !strings.HasPrefix(r.Msg, "blocked: deleted") {
			t.Fatalf("republished deleted: %v %q", r.OK, r.Msg)
		}
		expired := rbSign(sk, 1, "gone", now-100, nostr.Tag{"expiration", fmt.Sprint(int64(now) - 50)})
		if r := c.Publish(expired); r.OK || !strings.HasPrefix(r.Msg, "invalid: expired") {
			t.Fatalf("expired: %v %q", r.OK, r.Msg)
		}
	})

	t.Run("AUTH against the served URL and a protected event", func(t *testing.T) {
		sk, _ := testenv.NewKey()
		c := rbDial(t, r.URL)
		prot := rbSign(sk, 1, "protected", nostr.Now(), nostr.Tag{"-"})
		if res := c.Publish(prot); res.OK || !strings.HasPrefix(res.Msg, "auth-required:") {
			t.Fatalf("protected before AUTH: %v %q", res.OK, res.Msg)
		}
		// The relay tag names the served URL with a trailing slash: it must still match.
		if res := c.AuthWith(sk, r.URL+"/"); !res.OK {
			t.Fatalf("AUTH refused: %s", res.Msg)
		}
		if res := c.Publish(prot); !res.OK {
			t.Fatalf("protected after AUTH: %q", res.Msg)
		}
	})

	t.Run("oversized frame closes with 1009", func(t *testing.T) {
		c := rbDial(t, r.URL)
		big := `["EVENT",{"content":"` + strings.Repeat("x", 200_000) + `"}]`
		// The write may end early: the relay closes from the frame's header, and the client's
		// reader answers that close before the last bytes are out. The close code is the check.
		_ = c.TrySendRaw([]byte(big))
		var ce *websocket.CloseError
		if err := c.WaitClosed(20 * time.Second); !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig {
			t.Fatalf("want 1009, got %v", err)
		}
	})

	t.Run("graceful stop closes clients with 1001", func(t *testing.T) {
		c := rbDial(t, r.URL)
		c.Req(nostr.Filter{Kinds: []int{1}, Limit: 1})
		go r.Stop()
		var ce *websocket.CloseError
		if err := c.WaitClosed(30 * time.Second); !errors.As(err, &ce) || ce.Code != websocket.CloseGoingAway {
			t.Fatalf("want 1001, got %v", err)
		}
		<-r.Done()
	})
}
