package dm

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Interleavings of a hide and a message on two connections, PostgreSQL-isolation-test style:
// each step runs on a named session; "blocked" is observed in pg_stat_activity, not guessed.

// A hide that commits before the message is cleared by it.
func TestRaceHideCommitsFirstIsCleared(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	h, m := e.session("hide"), e.session("msg")

	h.Begin()
	h.MustAccept(b.Event(t, 41012, nostr.Tags{{"h", ch}}, ""))
	m.Begin()
	var mok bool
	var mmsg string
	var merr error
	msgEv := a.Event(t, 9, nostr.Tags{{"h", ch}}, "") // signed here: Event may fail the test
	done := async(func() { mok, mmsg, merr = m.Accept(msgEv) })
	if !e.waitBlockedOrDone(m.PID, done) {
		t.Fatal("the message did not wait for the uncommitted hide")
	}
	h.Commit()
	<-done
	must(t, mok, mmsg, merr)
	m.Commit()
	if e.hidden(b, ch) {
		t.Fatal("a hide that committed before the message was not cleared")
	}
	e.assertAgree(b, 2)
}

// A hide that commits after the message stays. This is the trap a plain UPDATE ... WHERE
// hidden_at IS NOT NULL falls into: the message's scan does not see a hide that is not yet
// written, the hide then commits FIRST, and the message never clears it. Locking every member
// row first makes the hide wait for the message, so its commit really comes after.
func TestRaceHideAfterMessageStays(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	h, m := e.session("hide"), e.session("msg")

	m.Begin()
	m.MustAccept(a.Event(t, 9, nostr.Tags{{"h", ch}}, ""))
	h.Begin()
	var hok bool
	var hmsg string
	var herr error
	hideEv := b.Event(t, 41012, nostr.Tags{{"h", ch}}, "") // signed here: Event may fail the test
	done := async(func() { hok, hmsg, herr = h.Accept(hideEv) })
	if !e.waitBlockedOrDone(h.PID, done) {
		t.Fatal("the hide did not wait for the uncommitted message: it could commit first and stay")
	}
	m.Commit()
	<-done
	must(t, hok, hmsg, herr)
	h.Commit()
	if !e.hidden(b, ch) {
		t.Fatal("a hide that committed after the message was cleared")
	}
	e.assertAgree(b, 1)
}

// result is one session's accept_event verdict; inTurn is a session whose statement runs in the
// background, to be committed in the order the locks decide.
type result struct {
	ok  bool
	msg string
	err error
}

type inTurn struct {
	name string
	s    *testenv.Session
	done <-chan struct{}
	r    *result
}

// Two messages and one hide: message 1 holds the DM; the hide and message 2 queue behind it.
// When message 1 commits, whichever of the two gets the rows first holds them until it commits
// (the other is seen blocked meanwhile), so the commit order is known, not guessed.
func TestRaceTwoMessagesOneHide(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	m1, h, m2 := e.session("msg1"), e.session("hide"), e.session("msg2")
	var hr, m2r result

	m1.Begin()
	m1.MustAccept(a.Event(t, 9, nostr.Tags{{"h", ch}}, ""))
	h.Begin()
	hideEv := b.Event(t, 41012, nostr.Tags{{"h", ch}}, "") // signed here: Event may fail the test
	hDone := async(func() { hr.ok, hr.msg, hr.err = h.Accept(hideEv) })
	if !e.waitBlockedOrDone(h.PID, hDone) {
		t.Fatal("the hide did not wait for message 1")
	}
	m2.Begin()
	msg2Ev := a.Event(t, 40002, nostr.Tags{{"h", ch}}, "")
	m2Done := async(func() { m2r.ok, m2r.msg, m2r.err = m2.Accept(msg2Ev) })
	if !e.waitBlockedOrDone(m2.PID, m2Done) {
		t.Fatal("message 2 did not wait for message 1")
	}
	m1.Commit()
	// Whichever statement finishes first holds the rows; the other must be seen waiting for it.
	hide := inTurn{"the hide", h, hDone, &hr}
	msg2 := inTurn{"message 2", m2, m2Done, &m2r}
	first, second := hide, msg2
	select {
	case <-hDone:
	case <-m2Done:
		first, second = msg2, hide
	}
	must(t, first.r.ok, first.r.msg, first.r.err)
	if !e.waitBlockedOrDone(second.s.PID, second.done) {
		t.Fatalf("%s did not wait for uncommitted %s", second.name, first.name)
	}
	first.s.Commit()
	<-second.done
	must(t, second.r.ok, second.r.msg, second.r.err)
	second.s.Commit()
	hideFirst := first.name == hide.name
	if hideFirst { // hide, then message 2: cleared, two generations
		if e.hidden(b, ch) {
			t.Fatal("the hide committed before message 2 but stays")
		}
		e.assertAgree(b, 2)
	} else { // message 2, then hide: hidden, one generation
		if !e.hidden(b, ch) {
			t.Fatal("the hide committed after message 2 but was cleared")
		}
		e.assertAgree(b, 1)
	}
}

// Two opens of the same set race: one channel, one creator.
func TestRaceOpenOpenSameSet(t *testing.T) {
	e := newEnv(t)
	a, b := newUser(), newUser()
	s1, s2 := e.session("open1"), e.session("open2")
	s1.Begin()
	ok, msg1, err := s1.Accept(a.Event(t, 41010, nostr.Tags{{"p", b.PK}}, ""))
	must(t, ok, msg1, err)
	var ok2 bool
	var msg2 string
	var err2 error
	open2 := b.Event(t, 41010, nostr.Tags{{"p", a.PK}}, "")
	s2.Begin()
	// The goroutine only records the outcome; must (t.Fatal) runs on the test's goroutine.
	done := async(func() { ok2, msg2, err2 = s2.Accept(open2) })
	if !e.waitBlockedOrDone(s2.PID, done) {
		t.Fatal("the second open did not wait on the first (participant hash)")
	}
	s1.Commit()
	<-done
	must(t, ok2, msg2, err2)
	s2.Commit()
	r1, r2 := parseResponse(t, msg1), parseResponse(t, msg2)
	if r1.ChannelID != r2.ChannelID || !r1.Created || r2.Created {
		t.Fatalf("two opens of one set: %+v and %+v", r1, r2)
	}
}

type openResponse struct {
	ChannelID string `json:"channel_id"`
	Created   bool   `json:"created"`
}

func parseResponse(t testing.TB, msg string) openResponse {
	t.Helper()
	var r openResponse
	if !strings.HasPrefix(msg, "response:") || json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &r) != nil {
		t.Fatalf("not a response: %q", msg)
	}
	return r
}

// One viewer hides two DMs at once on two sessions: their member rows differ, so nothing orders
// them before the viewer's state row. Both generations must count (target + 2): a bump that read
// the target and then wrote read + 1 would lose one, and the second change would be published as
// already done.
func TestRaceBumpsOfOneViewerFromTwoDMs(t *testing.T) {
	e := newEnv(t)
	a, b, c := newUser(), newUser(), newUser()
	ch1, ch2 := e.open(a, b), e.open(c, b)
	before, _, _ := e.vis(b)
	s1, s2 := e.session("hide1"), e.session("hide2")

	s1.Begin()
	s1.MustAccept(b.Event(t, 41012, nostr.Tags{{"h", ch1}}, ""))
	s2.Begin()
	var ok bool
	var msg string
	var err error
	hide2 := b.Event(t, 41012, nostr.Tags{{"h", ch2}}, "") // signed here: Event may fail the test
	done := async(func() { ok, msg, err = s2.Accept(hide2) })
	if !e.waitBlockedOrDone(s2.PID, done) {
		t.Fatal("the second hide did not wait for the first one's uncommitted bump")
	}
	s1.Commit()
	<-done
	must(t, ok, msg, err)
	s2.Commit()
	e.assertAgree(b, before+2)
}
