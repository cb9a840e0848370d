package store_test

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// heldBatcher is a Batcher whose first call stops before running, holding the only slot, so the
// events a test sends next queue behind it and go together in the second call: the interleaving
// that makes a batch, driven by a barrier instead of timing.
type heldBatcher struct {
	*store.Batcher
	t       *testing.T
	held    chan struct{} // closed when the first call reached onBatch
	release chan struct{}

	mu    sync.Mutex
	sizes []int
}

func newHeldBatcher(t *testing.T, url string) *heldBatcher {
	t.Helper()
	return newHeldBatcherOf(t, url, 32, 1)
}

// newHeldBatcherOf is newHeldBatcher with calls of at most maxEvents, inflight at once.
func newHeldBatcherOf(t *testing.T, url string, maxEvents, inflight int) *heldBatcher {
	t.Helper()
	h := &heldBatcher{
		Batcher: store.NewBatcher(context.Background(), testenv.Pool(t, url), maxEvents, inflight, 15*time.Second),
		t:       t, held: make(chan struct{}), release: make(chan struct{}),
	}
	h.SetOnBatch(func(n int) {
		h.mu.Lock()
		h.sizes = append(h.sizes, n)
		first := len(h.sizes) == 1
		h.mu.Unlock()
		if first {
			close(h.held)
			<-h.release
		}
	})
	t.Cleanup(func() {
		select {
		case <-h.release:
		default:
			close(h.release)
		}
	})
	return h
}

// lockProfile holds, in an open transaction, the advisory lock with which accept_event serialises
// writers of pk's profile (kind 0, a replaceable address; sql/0002_accept); Commit lets it go.
func lockProfile(t *testing.T, url, pk string) *testenv.Session {
	t.Helper()
	locker := testenv.NewSession(t, url, "locker")
	locker.Begin()
	if _, err := locker.Tx.Exec(context.Background(),
		`SELECT pg_advisory_xact_lock(hashtextextended('0:' || $1 || ':', 0))`, pk); err != nil {
		t.Fatal(err)
	}
	return locker
}

type verdictOf struct {
	ok  bool
	msg string
	err error
}

// send starts one Accept and returns where its verdict will arrive.
func (h *heldBatcher) send(ctx context.Context, ev *nostr.Event) <-chan verdictOf {
	raw, err := json.Marshal(ev)
	if err != nil {
		h.t.Fatal(err)
	}
	return h.sendRaw(ctx, raw)
}

func (h *heldBatcher) sendRaw(ctx context.Context, raw []byte) <-chan verdictOf {
	out := make(chan verdictOf, 1)
	go func() {
		ok, msg, err := h.Accept(ctx, raw, "")
		out <- verdictOf{ok, msg, err}
	}()
	return out
}

// hold sends a first event and waits until its call stops at onBatch, holding the slot.
func (h *heldBatcher) hold(u testenv.User) <-chan verdictOf {
	h.t.Helper()
	v := h.send(context.Background(), u.Event(h.t, 1, nil, "first"))
	select {
	case <-h.held:
	case <-time.After(10 * time.Second):
		h.t.Fatal("the first call never started")
	}
	return v
}

// waitQueued waits until n events wait in the queue (a condition on the batcher's state).
func (h *heldBatcher) waitQueued(n int) {
	h.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		q := h.Queued()
		if q == n {
			return
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("%d events queued, want %d", q, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// recordKeyOrders makes the batch hook record each call's keys, in the order the call runs them,
// holding the first call as newHeldBatcher does; it returns a reader of what was recorded.
func (h *heldBatcher) recordKeyOrders() func() [][]string {
	var mu sync.Mutex
	var orders [][]string
	h.SetOnBatchKeys(func(keys []string) {
		mu.Lock()
		orders = append(orders, keys)
		first := len(orders) == 1
		mu.Unlock()
		if first {
			close(h.held)
			<-h.release
		}
	})
	return func() [][]string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(orders)
	}
}

func (h *heldBatcher) callSizes() []int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.sizes)
}

// wait returns what arrives on c: an Accept's verdict or a group's verdicts. what names it in
// the failure when nothing arrives within 15 s.
func wait[V any](t *testing.T, c <-chan V, what string) V {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(15 * time.Second):
		t.Fatalf("%s: no verdict", what)
		var zero V
		return zero
	}
}

func storedCount(t *testing.T, url string, ids ...string) int {
	t.Helper()
	var n int
	if err := testenv.Pool(t, url).QueryRow(context.Background(),
		`SELECT count(*) FROM buzz.events WHERE id = ANY($1)`, ids).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Events that arrive while a call runs wait and go together in the next call: one transaction
// for all of them, each accepted.
func TestBatcherGroupsEventsThatArriveDuringACall(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	first := h.hold(u)
	var evs []*nostr.Event
	var verdicts []<-chan verdictOf
	for i := range 5 {
		ev := u.Event(t, 1, nil, "queued "+string(rune('a'+i)))
		evs = append(evs, ev)
		verdicts = append(verdicts, h.send(context.Background(), ev))
	}
	h.waitQueued(5)
	close(h.release)
	if v := wait(t, first, "first"); !v.ok || v.msg != "" || v.err != nil {
		t.Fatalf("first: %+v", v)
	}
	ids := []string{}
	for i, c := range verdicts {
		if v := wait(t, c, "queued"); !v.ok || v.msg != "" || v.err != nil {
			t.Fatalf("queued event %d: %+v", i, v)
		}
		ids = append(ids, evs[i].ID)
	}
	if got := h.callSizes(); !slices.Equal(got, []int{1, 5}) {
		t.Fatalf("call sizes %v, want [1 5]: the five queued events must go in one call", got)
	}
	if n := storedCount(t, url, ids...); n != 5 {
		t.Fatalf("%d of 5 stored", n)
	}
}

// Each event of a call gets the verdict accept_event gives it alone; a refused event rolls back
// alone (its subtransaction) and the others are stored.
func TestBatcherGivesEachEventItsOwnVerdict(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	fallbacks := func() float64 {
		return testutil.ToFloat64(metrics.AcceptBatchFallbacks.WithLabelValues("BZ400")) +
			testutil.ToFloat64(metrics.AcceptBatchFallbacks.WithLabelValues("BZ403"))
	}
	before := fallbacks()
	first := h.hold(u)

	good := u.Event(t, 1, nil, "good")
	unknown := u.Event(t, 9, nostr.Tags{{"h", "00000000-0000-4000-8000-00000000beef"}}, "to a channel that does not exist")
	badTags := []byte(`{"id":"` + good.ID[:63] + `0","pubkey":"` + u.PK + `","created_at":1,"kind":1,"tags":[[1]],"content":"","sig":"` + good.Sig + `"}`)
	later := u.Event(t, 1, nil, "later")
	want := []struct {
		ok  bool
		msg string
	}{
		{true, ""},
		{false, "restricted: unknown channel"},
		{false, "invalid: tags must be arrays of strings"},
		{true, "duplicate: already have this event"}, // good again, in the same call
		{true, ""},
	}
	verdicts := []<-chan verdictOf{}
	for _, s := range []func() <-chan verdictOf{
		func() <-chan verdictOf { return h.send(context.Background(), good) },
		func() <-chan verdictOf { return h.send(context.Background(), unknown) },
		func() <-chan verdictOf { return h.sendRaw(context.Background(), badTags) },
		func() <-chan verdictOf { return h.send(context.Background(), good) },
		func() <-chan verdictOf { return h.send(context.Background(), later) },
	} {
		verdicts = append(verdicts, s())
		h.waitQueued(len(verdicts)) // queue order is call order
	}
	close(h.release)
	wait(t, first, "first")
	for i, c := range verdicts {
		v := wait(t, c, "queued")
		if v.err != nil || v.ok != want[i].ok || v.msg != want[i].msg {
			t.Errorf("event %d: got ok=%v %q err=%v, want ok=%v %q", i, v.ok, v.msg, v.err, want[i].ok, want[i].msg)
		}
	}
	if got := h.callSizes(); !slices.Equal(got, []int{1, 5}) {
		t.Fatalf("call sizes %v, want [1 5]", got)
	}
	if got := fallbacks() - before; got != 0 {
		t.Fatalf("%v calls fell back to one event each: the refusals must be rows of the call, not abort it", got)
	}
	if n := storedCount(t, url, good.ID, later.ID); n != 2 {
		t.Fatalf("%d of the 2 good events stored", n)
	}
	if n := storedCount(t, url, unknown.ID); n != 0 {
		t.Fatal("the refused event was stored")
	}
}

// A call that waits on a lock longer than BatchLockWait gives up, and its events are stored one
// by one outside the slot: the ones that need no lock are answered while the lock is still held,
// so one blocked event does not stall the others.
func TestBatcherStoresABlockedEventAloneAndTheOthersAtOnce(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	locker := lockProfile(t, url, u.PK)
	before := testutil.ToFloat64(metrics.AcceptBatchFallbacks.WithLabelValues("55P03"))
	first := h.hold(u)
	profile := u.Event(t, 0, nil, `{"name":"blocked"}`)
	a, b := u.Event(t, 1, nil, "a"), u.Event(t, 1, nil, "b")
	vp := h.send(context.Background(), profile)
	h.waitQueued(1)
	va := h.send(context.Background(), a)
	vb := h.send(context.Background(), b)
	h.waitQueued(3)
	close(h.release)
	wait(t, first, "first")
	for name, c := range map[string]<-chan verdictOf{"a": va, "b": vb} {
		if v := wait(t, c, name+" (while the lock is held)"); !v.ok || v.msg != "" || v.err != nil {
			t.Fatalf("%s: %+v", name, v)
		}
	}
	select {
	case v := <-vp:
		t.Fatalf("the blocked event was answered while its lock is held: %+v", v)
	default:
	}
	if got := testutil.ToFloat64(metrics.AcceptBatchFallbacks.WithLabelValues("55P03")) - before; got != 1 {
		t.Fatalf("fallbacks for 55P03: %v, want 1", got)
	}
	locker.Commit()
	if v := wait(t, vp, "blocked event after the lock went"); !v.ok || v.msg != "" || v.err != nil {
		t.Fatalf("blocked event: %+v", v)
	}
	if n := storedCount(t, url, profile.ID, a.ID, b.ID); n != 3 {
		t.Fatalf("%d of 3 stored", n)
	}
}

// A caller that leaves while its event is queued gets its context's error, and the event is not
// stored: nobody would be told of it.
func TestBatcherDropsAnEventWhoseCallerLeft(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	first := h.hold(u)
	ctx, cancel := context.WithCancel(context.Background())
	gone := u.Event(t, 1, nil, "gone")
	vg := h.send(ctx, gone)
	h.waitQueued(1)
	stays := u.Event(t, 1, nil, "stays")
	vs := h.send(context.Background(), stays)
	h.waitQueued(2)
	cancel()
	if v := wait(t, vg, "cancelled"); !errors.Is(v.err, context.Canceled) {
		t.Fatalf("cancelled caller: %+v", v)
	}
	close(h.release)
	wait(t, first, "first")
	if v := wait(t, vs, "stays"); !v.ok || v.err != nil {
		t.Fatalf("stays: %+v", v)
	}
	if got := h.callSizes(); !slices.Equal(got, []int{1, 1}) {
		t.Fatalf("call sizes %v, want [1 1]", got)
	}
	if n := storedCount(t, url, gone.ID); n != 0 {
		t.Fatal("the event of a caller that left was stored")
	}
}

// accept_events (sql/0002_accept.up.sql) turns exactly the SQLSTATEs the relay maps to OK prefixes into rows;
// one missing there aborts whole calls, one missing here makes every such call fall back.
func TestAcceptEventsCatchesTheClientCodes(t *testing.T) {
	url := testenv.FreshDB(t)
	var def string
	if err := testenv.Pool(t, url).QueryRow(context.Background(),
		`SELECT pg_get_functiondef('buzz.accept_events(jsonb, integer)'::regprocedure)`).Scan(&def); err != nil {
		t.Fatal(err)
	}
	caught := map[string]bool{}
	for _, m := range regexp.MustCompile(`SQLSTATE '([0-9A-Z]{5})'`).FindAllStringSubmatch(def, -1) {
		caught[m[1]] = true
	}
	mapped := map[string]bool{}
	for _, code := range store.ClientSQLStates() {
		mapped[code] = true
	}
	if !maps.Equal(caught, mapped) {
		t.Fatalf("accept_events catches %v; the relay maps %v", slices.Sorted(maps.Keys(caught)), slices.Sorted(maps.Keys(mapped)))
	}
}

// A call that panics gives its slot back and answers the events it took: the panic reaches the
// caller that ran it (the relay's recover answers that client), and nobody else waits for ever.
func TestBatcherSurvivesAPanickingCall(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	second := make(chan struct{})
	h.SetOnBatch(func(n int) {
		h.mu.Lock()
		h.sizes = append(h.sizes, n)
		calls := len(h.sizes)
		h.mu.Unlock()
		switch calls {
		case 1:
			close(h.held)
			<-h.release
		case 2:
			close(second)
			panic("test: the call panics")
		}
	})
	u := testenv.NewUser()
	first := h.hold(u)
	recovering := func(ev *nostr.Event) <-chan verdictOf {
		out := make(chan verdictOf, 1)
		raw, _ := json.Marshal(ev)
		go func() {
			defer func() {
				if r := recover(); r != nil {
					out <- verdictOf{err: errors.New("panicked")}
				}
			}()
			ok, msg, err := h.Accept(context.Background(), raw, "")
			out <- verdictOf{ok, msg, err}
		}()
		return out
	}
	v1 := recovering(u.Event(t, 1, nil, "one"))
	v2 := recovering(u.Event(t, 1, nil, "two"))
	h.waitQueued(2)
	close(h.release)
	wait(t, first, "first")
	select {
	case <-second:
	case <-time.After(10 * time.Second):
		t.Fatal("the second call never started")
	}
	got := []string{}
	for _, c := range []<-chan verdictOf{v1, v2} {
		v := wait(t, c, "an event of the panicking call")
		if v.err == nil {
			t.Fatalf("an event of the panicking call was answered %+v", v)
		}
		got = append(got, v.err.Error())
	}
	slices.Sort(got)
	if got[0] != "panicked" || got[1] == "panicked" {
		t.Fatalf("verdicts %q: want the runner's panic and an error for the other", got)
	}
	if v := wait(t, h.send(context.Background(), u.Event(t, 1, nil, "after")), "an event after the panic"); !v.ok || v.err != nil {
		t.Fatalf("after the panic: %+v", v)
	}
}

// Shutdown ends the calls in flight (their runner is one client's goroutine, under no one
// connection's context). A call cut short may have committed, so its events are answered with an
// error, not stored again one by one.
func TestBatcherCallEndsWithItsBase(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	slowTrigger(t, url)
	base, halt := context.WithCancel(ctx)
	defer halt()
	b := store.NewBatcher(base, pool, 32, 1, 2*time.Minute) // longer than the wait below
	u := testenv.NewUser()
	out := make(chan verdictOf, 1)
	raw, _ := json.Marshal(u.Event(t, 1, nil, "slow"))
	go func() {
		ok, msg, err := b.Accept(ctx, raw, "")
		out <- verdictOf{ok, msg, err}
	}()
	// Barrier: the call sleeps in the trigger.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event = 'PgSleep' AND query LIKE '%accept_events%'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the call never reached the trigger")
		}
		time.Sleep(5 * time.Millisecond)
	}
	before := testenv.CounterTotal(t, "buzz_accept_batch_fallbacks_total")
	halt()
	v := wait(t, out, "the call after its base ended")
	if v.err == nil || v.ok || !strings.Contains(v.err.Error(), "outcome unknown") {
		t.Fatalf("verdict %+v, want an outcome-unknown error", v)
	}
	if got := testenv.CounterTotal(t, "buzz_accept_batch_fallbacks_total") - before; got != 0 {
		t.Fatalf("the cut call fell back to single calls (%v)", got)
	}
}

// slowTrigger makes the insert of an event whose content is "slow" sleep a minute.
func slowTrigger(t *testing.T, url string) {
	t.Helper()
	if _, err := testenv.Pool(t, url).Exec(context.Background(), `
		CREATE FUNCTION public.slow_insert() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(60); RETURN NEW; END $$;
		CREATE TRIGGER slow_insert BEFORE INSERT ON buzz.events
		  FOR EACH ROW WHEN (NEW.content = 'slow') EXECUTE FUNCTION public.slow_insert();`); err != nil {
		t.Fatal(err)
	}
}

// A call ends at the earliest deadline of its events (their owners answer "error:" then; the
// call must not go on to commit long after). The other events of the call are answered with an
// unknown outcome, not stored again.
func TestBatcherCallEndsAtTheEarliestDeadline(t *testing.T) {
	url := testenv.FreshDB(t)
	slowTrigger(t, url)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	first := h.hold(u)
	short, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	vs := h.send(short, u.Event(t, 1, nil, "slow"))
	h.waitQueued(1)
	other := u.Event(t, 1, nil, "other")
	vo := h.send(context.Background(), other)
	h.waitQueued(2)
	before := testenv.CounterTotal(t, "buzz_accept_batch_fallbacks_total")
	close(h.release)
	wait(t, first, "first")
	if v := wait(t, vs, "the event with the short deadline"); v.err == nil {
		t.Fatalf("short deadline: %+v", v)
	}
	v := wait(t, vo, "the other event of the call") // the call would sleep 60 s
	if v.err == nil || !strings.Contains(v.err.Error(), "outcome unknown") {
		t.Fatalf("other event: %+v, want an outcome-unknown error", v)
	}
	if got := testenv.CounterTotal(t, "buzz_accept_batch_fallbacks_total") - before; got != 0 {
		t.Fatalf("the cut call fell back to single calls (%v)", got)
	}
	if got := h.callSizes(); !slices.Equal(got, []int{1, 2}) {
		t.Fatalf("call sizes %v, want [1 2]", got)
	}
}

// An event with less than a second left does not join a call (it would cut the call short for
// the others): it is answered at once.
func TestBatcherLeavesOutAnEventWithNoTimeLeft(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	u := testenv.NewUser()
	first := h.hold(u)
	late, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	lateEv := u.Event(t, 1, nil, "late")
	vl := h.send(late, lateEv)
	h.waitQueued(1)
	vo := h.send(context.Background(), u.Event(t, 1, nil, "on time"))
	h.waitQueued(2)
	close(h.release)
	wait(t, first, "first")
	if v := wait(t, vl, "late"); v.err == nil {
		t.Fatalf("late event: %+v, want an error", v)
	}
	if v := wait(t, vo, "on time"); !v.ok || v.err != nil {
		t.Fatalf("on-time event: %+v", v)
	}
	if got := h.callSizes(); !slices.Equal(got, []int{1, 1}) {
		t.Fatalf("call sizes %v, want [1 1]: the late event must not join", got)
	}
	if storedCount(t, url, lateEv.ID) != 0 {
		t.Fatal("the late event was stored")
	}
}

// A call runs its events in lock-key order (the channel each names), whatever their arrival
// order, so two processes' calls lock the same DMs in the same order; each event still gets its
// own verdict.
func TestBatcherRunsACallInChannelOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	h := newHeldBatcher(t, url)
	keyOrders := h.recordKeyOrders()
	u := testenv.NewUser()
	first := h.hold(u)
	const unknownChannel = "00000000-0000-4000-8000-0000000000aa"
	type sent struct {
		key  string
		ev   *nostr.Event
		want string
	}
	all := []sent{
		{"c", u.Event(t, 1, nil, "c"), ""},
		{unknownChannel, u.Event(t, 9, nostr.Tags{{"h", unknownChannel}}, "refused"), "restricted: unknown channel"},
		{"", u.Event(t, 1, nil, "none"), ""},
		{"b", u.Event(t, 1, nil, "b"), ""},
		{"00", u.Event(t, 1, nil, "00"), ""},
	}
	verdicts := []<-chan verdictOf{}
	for i, s := range all {
		raw, _ := json.Marshal(s.ev)
		out := make(chan verdictOf, 1)
		go func() {
			ok, msg, err := h.Accept(context.Background(), raw, s.key)
			out <- verdictOf{ok, msg, err}
		}()
		verdicts = append(verdicts, out)
		h.waitQueued(i + 1)
	}
	close(h.release)
	wait(t, first, "first")
	for i, c := range verdicts {
		v := wait(t, c, "event "+all[i].key)
		if v.err != nil || v.msg != all[i].want || v.ok != (all[i].want == "") {
			t.Errorf("event with key %q: %+v, want %q", all[i].key, v, all[i].want)
		}
	}
	want := []string{"", "00", unknownChannel, "b", "c"}
	if orders := keyOrders(); len(orders) != 2 || !slices.Equal(orders[1], want) {
		t.Fatalf("calls ran in key orders %q, want the second %q", orders, want)
	}
}
