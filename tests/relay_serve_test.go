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

type rbClient struct {
	t         testing.TB
	ws        *websocket.Conn
	challenge string
}

func rbDial(t testing.TB, url string) *rbClient {
	t.Helper()
	ws, _, err := websocket.DefaultDialer.Dial(url, nil)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { ws.Close() })
	c := &rbClient{t: t, ws: ws}
	m := c.read()
	if rbStr(m[0]) != "AUTH" {
		t.Fatalf("first message %v", m)
	}
	c.challenge = rbStr(m[1])
	return c
}

func rbStr(r json.RawMessage) string {
	var s string
	_ = json.Unmarshal(r, &s)
	return s
}

func (c *rbClient) send(v ...any) {
	c.t.Helper()
	b, _ := json.Marshal(v)
	if err := c.ws.WriteMessage(websocket.TextMessage, b); err != nil {
		c.t.Fatal(err)
	}
}

func (c *rbClient) tryRead(d time.Duration) ([]json.RawMessage, error) {
	_ = c.ws.SetReadDeadline(time.Now().Add(d))
	_, b, err := c.ws.ReadMessage()
	if err != nil {
		return nil, err
	}
	var m []json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil || len(m) == 0 {
		return nil, fmt.Errorf("bad message %q", b)
	}
	return m, nil
}

func (c *rbClient) read() []json.RawMessage {
	c.t.Helper()
	m, err := c.tryRead(20 * time.Second)
	if err != nil {
		c.t.Fatalf("read: %v", err)
	}
	return m
}

// publish sends an EVENT and returns (ok, message) of its OK.
func (c *rbClient) publish(ev nostr.Event) (bool, string) {
	c.t.Helper()
	c.send("EVENT", ev)
	for {
		m := c.read()
		if rbStr(m[0]) == "OK" && rbStr(m[1]) == ev.ID {
			var ok bool
			_ = json.Unmarshal(m[2], &ok)
			return ok, rbStr(m[3])
		}
	}
}

// req returns stored events until EOSE, or the CLOSED reason.
func (c *rbClient) req(sub string, f ...nostr.Filter) ([]nostr.Event, string) {
	c.t.Helper()
	msg := []any{"REQ", sub}
	for _, x := range f {
		msg = append(msg, x)
	}
	c.send(msg...)
	var out []nostr.Event
	for {
		m := c.read()
		switch rbStr(m[0]) {
		case "EVENT":
			if rbStr(m[1]) == sub {
				var ev nostr.Event
				_ = json.Unmarshal(m[2], &ev)
				out = append(out, ev)
			}
		case "EOSE":
			if rbStr(m[1]) == sub {
				return out, ""
			}
		case "CLOSED":
			if rbStr(m[1]) == sub {
				return out, rbStr(m[2])
			}
		}
	}
}

func (c *rbClient) next(sub string) nostr.Event {
	c.t.Helper()
	for {
		m := c.read()
		if rbStr(m[0]) == "EVENT" && rbStr(m[1]) == sub {
			var ev nostr.Event
			_ = json.Unmarshal(m[2], &ev)
			return ev
		}
	}
}

func rbSign(sk string, kind int, content string, at nostr.Timestamp, tags ...nostr.Tag) nostr.Event {
	ev := nostr.Event{Kind: kind, Content: content, CreatedAt: at, Tags: nostr.Tags(tags)}
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
		if got, closed := sub.req("live", nostr.Filter{Authors: []string{pk}}); closed != "" || len(got) != 0 {
			t.Fatalf("initial: %d %q", len(got), closed)
		}
		pub := rbDial(t, r.URL)
		ev := rbSign(sk, 1, "hello", nostr.Now())
		if ok, msg := pub.publish(ev); !ok || msg != "" {
			t.Fatalf("OK %v %q", ok, msg)
		}
		if got := sub.next("live"); got.ID != ev.ID {
			t.Fatalf("live got %s", got.ID)
		}
		if ok, msg := pub.publish(ev); !ok || !strings.HasPrefix(msg, "duplicate:") {
			t.Fatalf("duplicate: %v %q", ok, msg)
		}
	})

	t.Run("replaceable, deletion, expiration", func(t *testing.T) {
		sk, pk := testenv.NewKey()
		c := rbDial(t, r.URL)
		now := nostr.Now()
		newer := rbSign(sk, 0, `{"name":"new"}`, now)
		older := rbSign(sk, 0, `{"name":"old"}`, now-10)
		if ok, msg := c.publish(newer); !ok {
			t.Fatal(msg)
		}
		if ok, msg := c.publish(older); ok || !strings.HasPrefix(msg, "duplicate: have newer") {
			t.Fatalf("older replaceable: %v %q", ok, msg)
		}
		got, _ := c.req("k0", nostr.Filter{Authors: []string{pk}, Kinds: []int{0}})
		if len(got) != 1 || got[0].ID != newer.ID {
			t.Fatalf("kind 0 head: %v", got)
		}
		note := rbSign(sk, 1, "to delete", now)
		c.publish(note)
		del := rbSign(sk, 5, "", now, nostr.Tag{"e", note.ID})
		if ok, msg := c.publish(del); !ok {
			t.Fatal(msg)
		}
		if got, _ := c.req("del", nostr.Filter{IDs: []string{note.ID}}); len(got) != 0 {
			t.Fatal("deleted event still served")
		}
		if ok, msg := c.publish(note); ok || !strings.HasPrefix(msg, "blocked: deleted") {
			t.Fatalf("republished deleted: %v %q", ok, msg)
		}
		expired := rbSign(sk, 1, "gone", now-100, nostr.Tag{"expiration", fmt.Sprint(int64(now) - 50)})
		if ok, msg := c.publish(expired); ok || !strings.HasPrefix(msg, "invalid: expired") {
			t.Fatalf("expired: %v %q", ok, msg)
		}
	})

	t.Run("AUTH against the served URL and a protected event", func(t *testing.T) {
		sk, _ := testenv.NewKey()
		c := rbDial(t, r.URL)
		prot := rbSign(sk, 1, "protected", nostr.Now(), nostr.Tag{"-"})
		if ok, msg := c.publish(prot); ok || !strings.HasPrefix(msg, "auth-required:") {
			t.Fatalf("protected before AUTH: %v %q", ok, msg)
		}
		auth := rbSign(sk, 22242, "", nostr.Now(), nostr.Tag{"relay", r.URL + "/"}, nostr.Tag{"challenge", c.challenge})
		c.send("AUTH", auth)
		for {
			m := c.read()
			if rbStr(m[0]) == "OK" {
				var ok bool
				_ = json.Unmarshal(m[2], &ok)
				if !ok {
					t.Fatalf("AUTH refused: %s", m[3])
				}
				break
			}
		}
		if ok, msg := c.publish(prot); !ok {
			t.Fatalf("protected after AUTH: %q", msg)
		}
	})

	t.Run("oversized frame closes with 1009", func(t *testing.T) {
		c := rbDial(t, r.URL)
		big := `["EVENT",{"content":"` + strings.Repeat("x", 200_000) + `"}]`
		if err := c.ws.WriteMessage(websocket.TextMessage, []byte(big)); err != nil {
			t.Fatal(err)
		}
		for {
			_, err := c.tryRead(20 * time.Second)
			if err == nil {
				continue
			}
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != websocket.CloseMessageTooBig {
				t.Fatalf("want 1009, got %v", err)
			}
			break
		}
	})

	t.Run("graceful stop closes clients with 1001", func(t *testing.T) {
		c := rbDial(t, r.URL)
		c.req("s", nostr.Filter{Kinds: []int{1}, Limit: 1})
		go r.Stop()
		for {
			_, err := c.tryRead(30 * time.Second)
			if err == nil {
				continue
			}
			var ce *websocket.CloseError
			if !errors.As(err, &ce) || ce.Code != websocket.CloseGoingAway {
				t.Fatalf("want 1001, got %v", err)
			}
			break
		}
		<-r.Done()
	})
}
