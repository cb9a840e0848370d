package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// alive proves the connection still works after a refused message.
func alive(t *testing.T, c *client) {
	t.Helper()
	sub := "alive-" + nonce()
	if _, closed := c.reqOrClosed(sub, nostr.Filter{IDs: []string{randHex64()}}); closed != "" {
		t.Fatalf("connection not usable: %s", closed)
	}
	c.sendJSON("CLOSE", sub)
}

func TestBadInput(t *testing.T) {
	tr := startRelay(t, func(c *Config) {
		c.MaxSubscriptions = 3
		c.MaxContentLength = 1000
		c.MaxEventTags = 5
		c.MaxMessageLength = 64 << 10
	})
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	noneStored := func(name string) {
		t.Helper()
		if n := tr.eventCount(t, "pubkey = $1", pk); n != 0 {
			t.Fatalf("%s: %d events stored", name, n)
		}
	}
	notice := func(name, raw string) {
		t.Helper()
		c.sendRaw([]byte(raw))
		m := c.expect("NOTICE")
		if !strings.HasPrefix(str(m[1]), "invalid:") {
			t.Fatalf("%s: %s", name, joinRaw(m))
		}
		alive(t, c)
	}
	notice("invalid JSON", `["REQ", "x", {`)
	notice("not an array", `{"hello":1}`)
	notice("unknown verb", `["HELLO", "x"]`)
	notice("verb by substring", `["XEVENTX", {}]`)
	notice("empty array", `[]`)
	notice("CLOSE without id", `["CLOSE"]`)

	okFalse := func(name string, ev nostr.Event, prefix string) {
		t.Helper()
		r := c.publish(ev)
		if r.ok || !strings.HasPrefix(r.msg, prefix) {
			t.Fatalf("%s: %+v", name, r)
		}
		noneStored(name)
		alive(t, c)
	}
	now := nostr.Now()
	wrongID := signed(sk, 1, "x", now)
	wrongID.Content = "tampered" // id no longer matches
	okFalse("wrong id", wrongID, "invalid:")
	badSig := signed(sk, 1, "x", now)
	badSig.Sig = strings.Repeat("ab", 64)
	okFalse("bad signature", badSig, "invalid:")
	okFalse("content too long", signed(sk, 1, strings.Repeat("x", 1001), now), "invalid:")
	okFalse("content too long in characters", signed(sk, 1, strings.Repeat("é", 1001), now), "invalid: content longer than 1000 characters")
	okFalse("too many tags", signed(sk, 1, "", now, nostr.Tag{"t", "1"}, nostr.Tag{"t", "2"}, nostr.Tag{"t", "3"}, nostr.Tag{"t", "4"}, nostr.Tag{"t", "5"}, nostr.Tag{"t", "6"}), "invalid:")
	okFalse("NUL in content", signed(sk, 1, "a\x00b", now), "invalid:")
	okFalse("NUL in tag", signed(sk, 1, "", now, nostr.Tag{"t", "a\x00"}), "invalid:")
	okFalse("far future", signed(sk, 1, "", now+3600), "invalid: created_at too far in future")
	okFalse("relay-only kind", signed(sk, 30622, "", now, nostr.Tag{"d", pk}, nostr.Tag{"p", pk}), "restricted: relay-only kind")
	okFalse("expired", signed(sk, 1, "", now-10, nostr.Tag{"expiration", fmt.Sprint(int64(now) - 5)}), "invalid:")
	okFalse("reminder without d", signed(sk, 30300, "", now), "invalid: missing d tag")
	okFalse("reminder not_before malformed", signed(sk, 30300, "", now, nostr.Tag{"d", "x"}, nostr.Tag{"not_before", "0123"}), "invalid: malformed not_before")

	// max_content_length counts unicode characters (NIP-11), not bytes: 1,000 two-byte ones fit.
	wideSK, widePK := testenv.NewKey()
	c.mustPublish(signed(wideSK, 1, strings.Repeat("é", 1000), now))
	if n := tr.eventCount(t, "pubkey = $1", widePK); n != 1 {
		t.Fatalf("1,000 two-byte characters: %d stored", n)
	}

	// A malformed EVENT whose id can be read still gets its OK.
	id := randHex64()
	c.sendRaw([]byte(`["EVENT",{"id":"` + id + `","kind":"one"}]`))
	if r := parseOK(t, c.expect("OK")); r.id != id || r.ok || !strings.HasPrefix(r.msg, "invalid:") {
		t.Fatalf("malformed EVENT: %+v", r)
	}
	c.sendRaw([]byte(`["EVENT",{"id":"` + id + `","pubkey":"` + pk + `","created_at":1,"kind":1,"tags":[[1]],"content":"","sig":"` + strings.Repeat("0", 128) + `"}]`))
	if r := parseOK(t, c.expect("OK")); r.ok || !strings.HasPrefix(r.msg, "invalid:") {
		t.Fatalf("non-string tag: %+v", r)
	}

	closed := func(name string, raw string, prefix string) {
		t.Helper()
		c.sendRaw([]byte(raw))
		m := c.expect("CLOSED")
		if str(m[1]) != "bad" || !strings.HasPrefix(str(m[2]), prefix) {
			t.Fatalf("%s: %s", name, joinRaw(m))
		}
		alive(t, c)
	}
	closed("non-hex ids", `["REQ","bad",{"ids":["xyz"]}]`, "invalid:")
	closed("uppercase author", `["REQ","bad",{"authors":["`+strings.ToUpper(pk)+`"]}]`, "invalid:")
	closed("multi-letter tag", `["REQ","bad",{"#tt":["a"]}]`, "invalid:")
	closed("negative limit", `["REQ","bad",{"limit":-1}]`, "invalid:")
	closed("kind out of range", `["REQ","bad",{"kinds":[70000]}]`, "invalid:")
	closed("search", `["REQ","bad",{"search":"hello"}]`, "invalid:")
	closed("filter not an object", `["REQ","bad",[1]]`, "invalid:")
	closed("no filter", `["REQ","bad"]`, "invalid:")
	hugeKinds := make([]int, maxFilterValues+1)
	hugeTags := make([]string, maxFilterValues+1)
	for i := range hugeKinds {
		hugeKinds[i] = i
		hugeTags[i] = fmt.Sprint(i)
	}
	hb, _ := json.Marshal([]any{"REQ", "bad", map[string]any{"kinds": hugeKinds}})
	closed("huge filter (kinds)", string(hb), "invalid:")
	hb, _ = json.Marshal([]any{"REQ", "bad", map[string]any{"#t": hugeTags}})
	closed("huge filter (tag values)", string(hb), "invalid:")
	many := []any{"REQ", "bad"}
	for i := 0; i < 17; i++ {
		many = append(many, map[string]any{"kinds": []int{i}})
	}
	mb, _ := json.Marshal(many)
	closed("too many filters", string(mb), "invalid:")
	closed("COUNT with bad filter", `["COUNT","bad",{"ids":["nothex"]}]`, "invalid:")

	// Subscriptions per connection.
	for i := 0; i < 3; i++ {
		c.req(fmt.Sprintf("keep%d", i), nostr.Filter{IDs: []string{randHex64()}})
	}
	c.sendRaw([]byte(`["REQ","bad",{"kinds":[1]}]`))
	if m := c.expect("CLOSED"); str(m[1]) != "bad" || !strings.HasPrefix(str(m[2]), "restricted:") {
		t.Fatalf("too many subscriptions: %s", joinRaw(m))
	}
	c.sendJSON("REQ", "keep0", nostr.Filter{Kinds: []int{1}, Limit: 1}) // replacing is still fine
	if _, cl := c.collect("keep0"); cl != "" {
		t.Fatalf("replacing at the limit: %s", cl)
	}
	noneStored("after all refusals")

	// An oversized frame closes the connection with 1009.
	c.sendRaw([]byte(`["EVENT",{"content":"` + strings.Repeat("x", 64<<10) + `"}]`))
	c.expectClose1009(t, "oversized frame")
	// Other connections are unaffected.
	alive(t, tr.dial(t))
}

// A deletion names at most maxDeletionTargets events or addresses: each one is a lock held in
// PostgreSQL's shared lock table until the deletion commits.
func TestDeletionTargetCap(t *testing.T) {
	tr := startRelay(t, nil)
	c := tr.dial(t)
	sk, pk := testenv.NewKey()
	now := nostr.Now()
	targets := func(n int) nostr.Tags {
		tags := nostr.Tags{}
		for i := range n {
			if i%2 == 0 {
				tags = append(tags, nostr.Tag{"e", randHex64()})
			} else {
				tags = append(tags, nostr.Tag{"a", fmt.Sprintf("30023:%s:d%d", pk, i)})
			}
		}
		return tags
	}
	over := signed(sk, 5, "", now, targets(maxDeletionTargets+1)...)
	if r := c.publish(over); r.ok || !strings.HasPrefix(r.msg, "invalid: a deletion names at most") {
		t.Fatalf("%d targets: %+v", maxDeletionTargets+1, r)
	}
	tombstones := func() int {
		var n int
		if err := tr.pool.QueryRow(context.Background(), `SELECT
		    (SELECT count(*) FROM buzz.events WHERE pubkey = $1)
		  + (SELECT count(*) FROM buzz.deleted_ids WHERE pubkey = $1)
		  + (SELECT count(*) FROM buzz.deleted_addresses WHERE pubkey = $1)`, pk).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := tombstones(); n != 0 {
		t.Fatalf("the refused deletion left %d rows", n)
	}
	// Tags other than e and a do not count, and the cap itself is accepted.
	at := signed(sk, 5, "", now, append(targets(maxDeletionTargets), nostr.Tag{"k", "1"}, nostr.Tag{"p", pk})...)
	c.mustPublish(at)
	if n := tombstones(); n != 1+maxDeletionTargets {
		t.Fatalf("deletion of %d targets: %d rows (event + tombstones), want %d", maxDeletionTargets, n, 1+maxDeletionTargets)
	}
}

func TestNIP11(t *testing.T) {
	tr := startRelay(t, func(c *Config) { c.SendQueueBytes = 1 << 20 })
	req, _ := http.NewRequest("GET", tr.http+"/", nil)
	req.Header.Set("Accept", "application/nostr+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if ct := resp.Header.Get("Content-Type"); ct != "application/nostr+json" || resp.Header.Get("Access-Control-Allow-Origin") != "*" {
		t.Fatalf("headers: %v", resp.Header)
	}
	var doc struct {
		Pubkey     string         `json:"pubkey"`
		NIPs       []int          `json:"supported_nips"`
		Extensions []string       `json:"supported_extensions"`
		Limitation map[string]any `json:"limitation"`
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.Pubkey != tr.s.RelayPubkey() || doc.Pubkey == "" {
		t.Fatalf("pubkey %q", doc.Pubkey)
	}
	if fmt.Sprint(doc.NIPs) != "[1 9 11 40 42 45 70]" || fmt.Sprint(doc.Extensions) != "[nip-dv nip-er]" {
		t.Fatalf("nips %v ext %v", doc.NIPs, doc.Extensions)
	}
	for k, want := range map[string]float64{
		"max_message_length": 131072, "max_subscriptions": 32, "max_filters": 16, "max_limit": 5000,
		"max_event_tags": 2000, "max_content_length": 65536, "created_at_upper_limit": 900,
		"send_queue_bytes": 1 << 20, "max_filter_values": 1000, "max_connection_filter_values": 10000,
		"max_deletion_targets": maxDeletionTargets,
	} {
		if got, _ := doc.Limitation[k].(float64); got != want {
			t.Errorf("limitation.%s = %v, want %v", k, doc.Limitation[k], want)
		}
	}
	if doc.Limitation["auth_required"] != false {
		t.Errorf("auth_required %v", doc.Limitation["auth_required"])
	}
}
