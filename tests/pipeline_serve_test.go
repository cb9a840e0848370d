package tests

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// okLog records the ids of OKs in the order they arrive.
type okLog struct {
	mu  sync.Mutex
	ids []string
	bad []string
}

func (l *okLog) option(want map[string]bool) testenv.ClientOption {
	return testenv.OnOK(func(id string, ok bool, msg string, _ time.Time) {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.ids = append(l.ids, id)
		if w, known := want[id]; known && w != ok {
			l.bad = append(l.bad, fmt.Sprintf("%s: ok=%v %q", id[:8], ok, msg))
		}
	})
}

func (l *okLog) wait(t *testing.T, n int) ([]string, []string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		l.mu.Lock()
		got, bad := slices.Clone(l.ids), slices.Clone(l.bad)
		l.mu.Unlock()
		if len(got) >= n {
			return got, bad
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d OKs after 60 s", len(got), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// EVENTs sent on one socket without waiting are stored in their order: each after every earlier
// one has committed, or after it in the same transaction (relay/pipeline.go). A DM message
// followed at once by its deletion, and a DM open followed at once by a message, always work.
// The deletion names no channel and the message does: stored in lock-key order, or in
// two calls racing, the deletion would come first and the message be refused as deleted.
func TestPipelinedEventsKeepTheirOrder(t *testing.T) {
	r := testenv.StartRelay(t, testenv.RelayOpts{})
	aSK, aPK := testenv.NewKey()
	_, bPK := testenv.NewKey()
	setup := rbDial(t, r.URL)
	setup.Auth(aSK)
	channel := fanOpenDM(t, setup, fanUser{aSK, aPK}, bPK)

	const pairs = 150
	var sent []*nostr.Event
	want := map[string]bool{}
	for i := range pairs {
		msg := rbSign(aSK, 9, fmt.Sprint("message ", i), nostr.Now(), nostr.Tag{"h", channel})
		del := rbSign(aSK, 5, "", nostr.Now(), nostr.Tag{"e", msg.ID})
		sent = append(sent, msg, del)
		if i%10 == 9 {
			// The DM open names no channel either: an open and a message right behind it.
			open := rbSign(aSK, 41010, "", nostr.Now(), nostr.Tag{"p", bPK})
			next := rbSign(aSK, 9, fmt.Sprint("after open ", i), nostr.Now(), nostr.Tag{"h", channel})
			sent = append(sent, open, next)
		}
	}
	for _, ev := range sent {
		want[ev.ID] = true
	}
	var log okLog
	c := testenv.Dial(t, r.URL, log.option(want))
	c.Auth(aSK)
	for _, ev := range sent {
		c.SendEvent(ev)
	}
	got, bad := log.wait(t, len(sent)+1) // +1: the AUTH's OK
	if len(bad) > 0 {
		t.Fatalf("%d EVENTs refused, first %q", len(bad), bad[:min(len(bad), 5)])
	}
	// A REQ waits for the EVENTs before it: none of the deleted messages is served.
	sub := c.Req(nostr.Filter{Kinds: []int{9}, Tags: nostr.TagMap{"h": {channel}}, Limit: 500})
	if n := len(sub.Events()); n != pairs/10 {
		t.Fatalf("%d messages served, want the %d not deleted (OKs: %d)", n, pairs/10, len(got))
	}
}

// OKs come back in the order the EVENTs were sent, whatever answers them: the Go checks in the
// read loop (a bad signature), the ephemeral dedupe, or accept_event.
func TestPipelinedOKsComeBackInSendOrder(t *testing.T) {
	r := testenv.StartRelay(t, testenv.RelayOpts{})
	sk, _ := testenv.NewKey()
	var sent []*nostr.Event
	want := map[string]bool{}
	for i := range 400 {
		ev := rbSign(sk, 1, fmt.Sprint("note ", i), nostr.Now())
		switch i % 7 {
		case 3: // a bad signature: refused in the read loop, before SQL
			ev.Sig = ev.Sig[:len(ev.Sig)-2] + fmt.Sprintf("%02x", (int(ev.Sig[len(ev.Sig)-1])+1)%256)
			want[ev.ID] = false
		case 5: // an ephemeral event, sent twice: the second is a duplicate, still OK true
			ev = rbSign(sk, 20001, fmt.Sprint("typing ", i), nostr.Now())
			sent = append(sent, ev)
			want[ev.ID] = true
		default:
			want[ev.ID] = true
		}
		sent = append(sent, ev)
	}
	var log okLog
	c := testenv.Dial(t, r.URL, log.option(want))
	for _, ev := range sent {
		c.SendEvent(ev)
	}
	got, bad := log.wait(t, len(sent))
	if len(bad) > 0 {
		t.Fatalf("%d unexpected verdicts, first %q", len(bad), bad[:min(len(bad), 5)])
	}
	for i, ev := range sent {
		if got[i] != ev.ID {
			t.Fatalf("OK %d is for %s, want %s (the EVENT sent %d-th)", i, got[i][:8], ev.ID[:8], i)
		}
	}
}
