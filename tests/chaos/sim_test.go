package chaos

import (
	"encoding/json"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/wsclient"
)

// ---- the log every simulated client writes: what it sent, what came back, what it received ----

type sentRec struct {
	Ev   *nostr.Event
	Conn int
	User string
	At   time.Time
	OK   *wsclient.OK // nil: no answer (connection lost or timed out): outcome unknown
}

type recvRec struct {
	Conn int
	Sub  string
	Ev   *nostr.Event
	At   time.Time
}

type connRec struct {
	ID       int
	User     string // pubkey, or "anonymous"
	Role     string // user, anonymous, outsider
	URL      string
	Opened   time.Time
	Closed   time.Time            // zero while open
	AuthSent map[string]time.Time // pubkey -> when the AUTH frame was written
	EOSE     map[string]time.Time // sub -> when its initial results ended
}

type recorder struct {
	mu       sync.Mutex
	conns    []*connRec
	sent     []*sentRec
	byID     map[string]*sentRec
	recv     []recvRec
	out      *os.File
	outMu    sync.Mutex
	channels map[string][]string // channel id -> members (learned from 41010 OKs)
	userChs  map[string][]string // pubkey -> channel ids
}

func newRecorder(path string) (*recorder, error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	return &recorder{out: f, byID: map[string]*sentRec{}, channels: map[string][]string{}, userChs: map[string][]string{}}, nil
}

func (r *recorder) log(v map[string]any) {
	v["t"] = time.Now().Format("15:04:05.000000")
	b, _ := json.Marshal(v)
	r.outMu.Lock()
	_, _ = r.out.Write(append(b, '\n'))
	r.outMu.Unlock()
}

// dueSoon lists the reminders that got OK true and come due between a second before now and within.
func (r *recorder) dueSoon(now time.Time, within time.Duration) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, s := range r.sent {
		if s.Ev.Kind != 30300 || s.OK == nil || !s.OK.OK {
			continue
		}
		for _, tg := range s.Ev.Tags {
			if len(tg) >= 2 && tg[0] == "not_before" {
				nb, _ := strconv.ParseInt(tg[1], 10, 64)
				if at := time.Unix(nb, 0); at.After(now.Add(-time.Second)) && at.Before(now.Add(within)) {
					out = append(out, s.Ev.ID)
				}
			}
		}
	}
	return out
}

func (r *recorder) newConn(user, role, url string) *connRec {
	r.mu.Lock()
	c := &connRec{ID: len(r.conns), User: user, Role: role, URL: url, Opened: time.Now(),
		AuthSent: map[string]time.Time{}, EOSE: map[string]time.Time{}}
	r.conns = append(r.conns, c)
	r.mu.Unlock()
	r.log(map[string]any{"ev": "open", "conn": c.ID, "user": user, "role": role, "url": url})
	return c
}

func (r *recorder) closed(c *connRec, why error) {
	r.mu.Lock()
	if c.Closed.IsZero() {
		c.Closed = time.Now()
	}
	r.mu.Unlock()
	r.log(map[string]any{"ev": "close", "conn": c.ID, "why": fmt.Sprint(why)})
}

func (r *recorder) handlers(c *connRec) wsclient.Handlers {
	return wsclient.Handlers{
		OnEvent: func(sub string, ev *nostr.Event, at time.Time) {
			r.mu.Lock()
			r.recv = append(r.recv, recvRec{Conn: c.ID, Sub: sub, Ev: ev, At: at})
			r.mu.Unlock()
			r.log(map[string]any{"ev": "recv", "conn": c.ID, "sub": sub, "id": ev.ID, "kind": ev.Kind, "event": ev})
		},
		OnOK: func(o wsclient.OK) {
			r.mu.Lock()
			if s := r.byID[o.ID]; s != nil && s.Conn == c.ID && s.OK == nil {
				oc := o
				s.OK = &oc
			}
			r.mu.Unlock()
			r.log(map[string]any{"ev": "ok", "conn": c.ID, "id": o.ID, "ok": o.OK, "msg": o.Msg})
		},
		OnEOSE: func(sub string, at time.Time) {
			r.mu.Lock()
			c.EOSE[sub] = at
			r.mu.Unlock()
			r.log(map[string]any{"ev": "eose", "conn": c.ID, "sub": sub})
		},
		OnClosed: func(sub, msg string, at time.Time) {
			r.log(map[string]any{"ev": "closed", "conn": c.ID, "sub": sub, "msg": msg})
		},
		OnNotice: func(msg string, at time.Time) {
			r.log(map[string]any{"ev": "notice", "conn": c.ID, "msg": msg})
		},
	}
}

// publish sends ev on cl (connection c) and waits for its OK; the send is logged first.
func (r *recorder) publish(cl *wsclient.Client, c *connRec, user string, ev *nostr.Event) (wsclient.OK, error) {
	s := &sentRec{Ev: ev, Conn: c.ID, User: user, At: time.Now()}
	r.mu.Lock()
	if _, dup := r.byID[ev.ID]; !dup {
		r.sent = append(r.sent, s)
		r.byID[ev.ID] = s
	}
	r.mu.Unlock()
	raw, _ := json.Marshal(ev)
	r.log(map[string]any{"ev": "send", "conn": c.ID, "id": ev.ID, "kind": ev.Kind, "event": json.RawMessage(raw)})
	return cl.Publish(ev, 20*time.Second)
}

func (r *recorder) addChannel(ch string, members []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.channels[ch]; ok {
		return
	}
	r.channels[ch] = members
	for _, m := range members {
		r.userChs[m] = append(r.userChs[m], ch)
	}
}

func (r *recorder) channelsOf(pk string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.userChs[pk]...)
}

// ---- simulated clients ----

type world struct {
	rec      *recorder
	fleet    *fleet
	relaySK  string
	relayPK  string
	users    []bench.User
	stopActs chan struct{} // closed: no more actions (connections stay, for due signals)
	stopAll  chan struct{} // closed: close connections and return
	wg       sync.WaitGroup
	logf     func(string, ...any)
}

var farSince = nostr.Timestamp(4102444800) // 2100-01-01: only due signals (they ignore since) match

// connect dials a random live relay, authenticates as sk (unless empty) and opens subs.
func (w *world) connect(rng *rand.Rand, user bench.User, role string, subs func(pk string) map[string]nostr.Filter) (*wsclient.Client, *connRec, error) {
	live := w.fleet.live()
	if len(live) == 0 {
		return nil, nil, errors.New("no live relay")
	}
	url := live[rng.Intn(len(live))]
	name := user.PK
	if role == "anonymous" {
		name = "anonymous"
	}
	c := w.rec.newConn(name, role, url)
	h := w.rec.handlers(c)
	h.OnEnd = func(err error, at time.Time) { w.rec.closed(c, err) }
	cl, err := wsclient.Dial(url, h, 5*time.Second)
	if err != nil {
		w.rec.closed(c, err)
		return nil, nil, err
	}
	if role != "anonymous" {
		err := cl.Auth(user.SK, 10*time.Second, func() {
			w.rec.mu.Lock()
			c.AuthSent[user.PK] = time.Now()
			w.rec.mu.Unlock()
			w.rec.log(map[string]any{"ev": "auth", "conn": c.ID, "pubkey": user.PK})
		})
		if err != nil {
			cl.Close()
			return nil, nil, err
		}
	}
	for id, f := range subs(user.PK) {
		if err := cl.Req(id, 10*time.Second, f); err != nil {
			if errors.Is(err, wsclient.ErrClosed) || errors.Is(err, wsclient.ErrTimeout) {
				cl.Close()
				return nil, nil, err
			}
			// CLOSED by the relay (a gate): logged by the handler; the sub simply does not exist.
		}
	}
	return cl, c, nil
}

func userSubs(relayPK string) func(pk string) map[string]nostr.Filter {
	return func(pk string) map[string]nostr.Filter {
		return map[string]nostr.Filter{
			"snap": {Kinds: []int{30622}, Authors: []string{relayPK}, Tags: nostr.TagMap{"p": {pk}}},
			"all":  {Kinds: []int{9, 41010, 41011, 41012, 30300, 30622, 1059}, Limit: 20},
			"due":  {Kinds: []int{30300}, Authors: []string{pk}, Since: &farSince},
		}
	}
}

func snoopSubs(string) map[string]nostr.Filter {
	return map[string]nostr.Filter{
		"all": {Kinds: []int{9, 41010, 41011, 41012, 30300, 30622, 1059}, Limit: 50},
		"dm":  {Kinds: []int{9}, Limit: 50},
	}
}

// runPassive keeps one connection open (reconnecting) until stopAll.
func (w *world) runPassive(seed int64, user bench.User, role string) {
	defer w.wg.Done()
	rng := rand.New(rand.NewSource(seed))
	subs := snoopSubs
	for {
		select {
		case <-w.stopAll:
			return
		default:
		}
		cl, _, err := w.connect(rng, user, role, subs)
		if err != nil {
			if !sleepOr(w.stopAll, 300*time.Millisecond) {
				return
			}
			continue
		}
		select {
		case <-cl.Done():
		case <-w.stopAll:
			cl.Close()
			return
		}
	}
}

// runUser is one simulated user: it keeps a connection (reconnecting on failure) and acts.
func (w *world) runUser(seed int64, me bench.User) {
	defer w.wg.Done()
	rng := rand.New(rand.NewSource(seed))
	var cl *wsclient.Client
	var c *connRec
	acting := true
	for {
		select {
		case <-w.stopAll:
			if cl != nil {
				cl.Close()
			}
			return
		case <-w.stopActs:
			acting = false
		default:
		}
		if cl != nil {
			select {
			case <-cl.Done():
				cl = nil
			default:
			}
		}
		if cl == nil {
			var err error
			cl, c, err = w.connect(rng, me, "user", userSubs(w.relayPK))
			if err != nil {
				cl = nil
				if !sleepOr(w.stopAll, 300*time.Millisecond) {
					return
				}
				continue
			}
		}
		if !acting {
			select {
			case <-cl.Done():
			case <-w.stopAll:
			}
			continue
		}
		ev := w.nextAction(rng, me)
		o, err := w.rec.publish(cl, c, me.PK, ev)
		if err != nil {
			// Outcome unknown (the relay may have stored it): drop this connection, reconnect.
			cl.Close()
			cl = nil
			continue
		}
		if ev.Kind == 41010 && o.OK && strings.HasPrefix(o.Msg, "response:") {
			var resp struct {
				ChannelID string `json:"channel_id"`
			}
			if json.Unmarshal([]byte(strings.TrimPrefix(o.Msg, "response:")), &resp) == nil && resp.ChannelID != "" {
				members := []string{me.PK}
				for _, t := range ev.Tags {
					if len(t) >= 2 && t[0] == "p" {
						members = append(members, t[1])
					}
				}
				w.rec.addChannel(resp.ChannelID, members)
			}
		}
		if !sleepOr(w.stopActs, time.Duration(80+rng.Intn(250))*time.Millisecond) {
			acting = false
		}
	}
}

// nextAction picks what a user does next: open a DM (with one or two others), hide one, send a
// message (which resurfaces it for members who hid it), have the relay post on its behalf, or arm a
// reminder due in 1-6 s (re-arming one of four addresses, so newer versions supersede older ones).
func (w *world) nextAction(rng *rand.Rand, me bench.User) *nostr.Event {
	chs := w.rec.channelsOf(me.PK)
	x := rng.Intn(100)
	if len(chs) == 0 || x < 8 {
		others := []bench.User{}
		for len(others) < 1+rng.Intn(2) {
			o := w.users[rng.Intn(len(w.users))]
			if o.PK != me.PK {
				others = append(others, o)
			}
		}
		tags := nostr.Tags{}
		for _, o := range others {
			tags = append(tags, nostr.Tag{"p", o.PK})
		}
		return me.Sign(41010, tags, "")
	}
	ch := chs[rng.Intn(len(chs))]
	switch {
	case x < 30:
		return me.Sign(41012, nostr.Tags{{"h", ch}}, "")
	case x < 62:
		return me.Sign(9, nostr.Tags{{"h", ch}}, "msg "+strconv.Itoa(rng.Int()))
	case x < 77:
		ev := &nostr.Event{Kind: 9, CreatedAt: nostr.Now(), Tags: nostr.Tags{{"h", ch}, {"actor", me.PK}},
			Content: "relay-signed for " + me.PK[:8] + " " + strconv.Itoa(rng.Int())}
		if err := ev.Sign(w.relaySK); err != nil {
			panic(err)
		}
		return ev
	default:
		nb := time.Now().Unix() + 1 + int64(rng.Intn(6))
		return me.Sign(30300, nostr.Tags{{"d", "r" + strconv.Itoa(rng.Intn(4))}, {"not_before", strconv.FormatInt(nb, 10)}},
			"ciphertext "+strconv.Itoa(rng.Int()))
	}
}

func sleepOr(stop <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-stop:
		return false
	case <-t.C:
		return true
	}
}
