package chaos

import (
	"fmt"
	"math"
	"math/rand"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Fault kinds. Every relay fault leaves at least one other relay untouched.
const (
	fKill      = "kill -9"
	fFreeze    = "freeze (SIGSTOP past the leases)"
	fCut       = "network cut"
	fCutCommit = "network cut mid-commit"
	fPGRestart = "PostgreSQL immediate restart"
	fSlotLoss  = "replication slot invalidated"
	fHostPause = "host paused (not injected)"
)

var faultKinds = []string{fKill, fFreeze, fCut, fCutCommit, fPGRestart, fSlotLoss, fHostPause}

// deck is the mix the schedule draws from (reshuffled when used up); the first draws are one of
// each, so a short soak still sees every kind.
var deck = map[string]int{fKill: 13, fFreeze: 3, fCut: 2, fCutCommit: 1, fPGRestart: 1}

// window is a fault's span on one relay (relay -1: all of them); end is zero while it lasts.
type window struct {
	relay      int
	kind       string
	start, end time.Time
}

// injector runs the seeded fault schedule against the fleet and the cluster.
type injector struct {
	cl    *testenv.Cluster
	fl    *fleet
	dbURL string
	rng   *rand.Rand // only the schedule goroutine draws from it
	lease time.Duration
	logf  func(string, ...any)
	errf  func(string, ...any)
	obs   *observer
	// dueSoon lists reminders (ids) due within the next seconds, for freezes timed on a claim.
	dueSoon func() []string

	mu        sync.Mutex
	counts    map[string]int
	windows   []*window
	list      []string
	gaps      []slotGap
	skipped   []string
	busy      [3]bool
	exclusive bool // a slot invalidation runs: no other fault meanwhile (see slotLoss)

	pgMu     sync.Mutex // PostgreSQL restarts and slot invalidations, one at a time
	starting [3]atomic.Bool
	slotMu   [3]sync.Mutex
	wg       sync.WaitGroup
}

func newInjector(cl *testenv.Cluster, fl *fleet, dbURL string, seed int64, lease time.Duration, obs *observer,
	logf, errf func(string, ...any)) *injector {
	return &injector{cl: cl, fl: fl, dbURL: dbURL, rng: rand.New(rand.NewSource(seed ^ 0x5eed)), lease: lease,
		obs: obs, logf: logf, errf: errf, counts: map[string]int{}}
}

func (in *injector) note(s string) {
	in.mu.Lock()
	in.list = append(in.list, fmt.Sprintf("%s %s", time.Now().Format("15:04:05.000"), s))
	in.mu.Unlock()
	in.logf("fault: %s", s)
}

// open starts a window and counts the fault; close ends it.
func (in *injector) open(relay int, kind string) *window {
	w := &window{relay: relay, kind: kind, start: time.Now()}
	in.mu.Lock()
	in.windows = append(in.windows, w)
	in.counts[kind]++
	in.mu.Unlock()
	return w
}

func (in *injector) close(w *window) {
	in.mu.Lock()
	w.end = time.Now()
	in.mu.Unlock()
}

// ensure starts slot i again if it is down.
func (in *injector) ensure(i int) {
	in.starting[i].Store(true)
	defer in.starting[i].Store(false)
	in.slotMu[i].Lock()
	defer in.slotMu[i].Unlock()
	if contains(in.fl.down(), i) {
		if err := in.fl.start(i); err != nil {
			in.logf("relay %d restart failed: %v", i, err)
		}
	}
}

// supervise restarts what died on its own (not held down by a fault).
func (in *injector) supervise() {
	for _, i := range in.fl.down() {
		in.mu.Lock()
		held := in.busy[i]
		in.mu.Unlock()
		if !held && !in.starting[i].Load() {
			in.starting[i].Store(true)
			go in.ensure(i)
		}
	}
}

// run injects faults for dur: one every `every` on average (exponential gaps), kinds from the
// deck, and slot invalidations at fixed points of the run (one per 15 minutes, at least one).
func (in *injector) run(start time.Time, dur, every time.Duration) {
	end := start.Add(dur)
	var losses []time.Time
	nLoss := 1 + int(dur/(15*time.Minute))
	for k := 0; k < nLoss; k++ {
		losses = append(losses, start.Add(time.Duration(float64(dur)*(float64(k)+0.5)/float64(nLoss))))
	}
	var pile []string
	for _, k := range []string{fKill, fFreeze, fCut, fCutCommit, fPGRestart} {
		pile = append(pile, k)
	}
	in.rng.Shuffle(len(pile), func(a, b int) { pile[a], pile[b] = pile[b], pile[a] })
	next := time.Now().Add(in.gap(every))
	pending := ""
	for time.Now().Before(end) {
		time.Sleep(100 * time.Millisecond)
		in.supervise()
		now := time.Now()
		if len(losses) > 0 && now.After(losses[0]) && in.try(fSlotLoss) {
			losses = losses[1:]
		}
		if now.Before(next) {
			continue
		}
		if pending == "" {
			if len(pile) == 0 {
				pile = in.shuffledDeck()
			}
			pending, pile = pile[0], pile[1:]
		}
		if in.try(pending) {
			pending = ""
			next = now.Add(in.gap(every))
		}
	}
	for _, t := range losses {
		in.mu.Lock()
		in.skipped = append(in.skipped, fmt.Sprintf("slot invalidation due at %s never found a quiet moment", fmtTime(t)))
		in.mu.Unlock()
	}
	in.wg.Wait()
	for i := 0; i < 3; i++ {
		in.ensure(i)
	}
}

// gap draws an exponential time to the next fault with mean every, kept within [every/10, 4 every].
func (in *injector) gap(every time.Duration) time.Duration {
	f := -math.Log(1 - in.rng.Float64())
	return time.Duration(float64(every) * math.Min(4, math.Max(0.1, f)))
}

func (in *injector) shuffledDeck() []string {
	var out []string
	keys := make([]string, 0, len(deck))
	for k := range deck {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		for n := 0; n < deck[k]; n++ {
			out = append(out, k)
		}
	}
	in.rng.Shuffle(len(out), func(a, b int) { out[a], out[b] = out[b], out[a] })
	return out
}

// try starts a fault of kind if the fleet allows it now (false: try again later).
func (in *injector) try(kind string) bool {
	if kind == fPGRestart {
		in.mu.Lock()
		ex := in.exclusive
		in.mu.Unlock()
		if ex || !in.pgMu.TryLock() {
			return false
		}
		in.wg.Add(1)
		go in.pgRestart()
		return true
	}
	i := in.pickRelay(kind)
	if i < 0 {
		return false
	}
	delay := time.Duration(500+in.rng.Intn(2500)) * time.Millisecond
	in.wg.Add(1)
	go func() {
		defer in.wg.Done()
		defer in.release(i)
		switch kind {
		case fKill:
			in.kill(i, delay)
		case fFreeze:
			in.freeze(i, in.lease+time.Second+delay)
		case fCut:
			in.cut(i, 2*time.Second+delay, false)
		case fCutCommit:
			in.cut(i, time.Second+delay, true)
		case fSlotLoss:
			defer in.pgMu.Unlock()
			in.slotLoss(i)
		}
	}()
	return true
}

// pickRelay marks a running, untouched relay busy for kind, leaving another one untouched; -1
// when none may be taken now.
func (in *injector) pickRelay(kind string) int {
	down := in.fl.down()
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.exclusive {
		return -1
	}
	var free []int
	for i := 0; i < 3; i++ {
		if !in.busy[i] && !contains(down, i) && !in.starting[i].Load() {
			free = append(free, i)
		}
	}
	if len(free) < 2 {
		return -1
	}
	if kind == fSlotLoss {
		// Every other relay must keep up while the WAL moves on, or its slot is lost too.
		if len(free) < 3 || !in.pgMu.TryLock() {
			return -1
		}
		in.exclusive = true
	}
	i := free[in.rng.Intn(len(free))]
	in.busy[i] = true
	return i
}

func (in *injector) release(i int) {
	in.mu.Lock()
	in.busy[i] = false
	in.mu.Unlock()
}

func (in *injector) kill(i int, delay time.Duration) {
	w := in.open(i, fKill)
	if !in.fl.kill(i) {
		in.mu.Lock()
		in.counts[fKill]--
		in.mu.Unlock()
		in.close(w)
		return
	}
	in.note(fmt.Sprintf("kill -9 relay %d", i))
	time.Sleep(delay)
	in.ensure(i)
	in.close(w)
	in.note(fmt.Sprintf("relay %d restarted after %s", i, delay))
}

// freeze stops relay i for d (longer than its leases): its claims expire and are taken over while
// it sleeps; when it wakes its writes under the old claims must be fenced. When reminders are due
// in the next seconds, the stop waits (up to 5 s) for a server reply to relay i naming one of
// them, and happens before the relay reads it: often the reply of its claim, so it wakes holding
// a claim whose lease has passed, and confirms under a stamp that is no longer the row's.
func (in *injector) freeze(i int, d time.Duration) {
	w := in.open(i, fFreeze)
	defer in.close(w)
	p := in.fl.proc(i)
	if p == nil {
		return
	}
	stop := func() { _ = syscall.Kill(p.Pid(), syscall.SIGSTOP) }
	how := "at once (no reminder due in the next seconds)"
	if ids := in.dueSoon(); len(ids) > 0 {
		var markers [][]byte
		for _, id := range ids {
			markers = append(markers, []byte(id))
		}
		select {
		case <-in.fl.proxy[i].OnReply(stop, markers...):
			how = "as a reply naming a due reminder reached it"
		case <-time.After(5 * time.Second):
			in.fl.proxy[i].Disarm()
			stop()
			how = "at once (no reply naming a due reminder within 5s)"
		}
	} else {
		stop()
	}
	in.note(fmt.Sprintf("SIGSTOP relay %d (pid %d) %s, for %s", i, p.Pid(), how, d))
	time.Sleep(d)
	_ = syscall.Kill(p.Pid(), syscall.SIGCONT)
	in.note(fmt.Sprintf("SIGCONT relay %d (pid %d)", i, p.Pid()))
}

// cut takes relay i's network to PostgreSQL away for d (every connection: pools and replication);
// midCommit waits (up to 5 s) for the reply of a committed transaction and drops it, so the server committed a
// transaction whose outcome the relay never learns.
func (in *injector) cut(i int, d time.Duration, midCommit bool) {
	kind := fCut
	if midCommit {
		kind = fCutCommit
	}
	w := in.open(i, kind)
	defer in.close(w)
	px := in.fl.proxy[i]
	how := "cut"
	if midCommit {
		select {
		case <-px.CutOnReply(testenv.ReplyCommit, testenv.ReplyCommitted):
			how = "cut on a committed transaction's reply"
		case <-time.After(5 * time.Second):
			px.Cut()
			how = "cut (no COMMIT within 5s)"
		}
	} else {
		px.Cut()
	}
	in.note(fmt.Sprintf("network relay %d <-> PostgreSQL %s for %s", i, how, d))
	time.Sleep(d)
	px.Restore()
	in.note(fmt.Sprintf("network relay %d <-> PostgreSQL restored (its connections reset)", i))
}

func (in *injector) pgRestart() {
	defer in.wg.Done()
	defer in.pgMu.Unlock()
	w := in.open(-1, fPGRestart)
	defer in.close(w)
	in.note("PostgreSQL immediate restart: begin")
	if err := in.cl.Restart(); err != nil {
		in.errf("%v", err)
	}
	in.note("PostgreSQL immediate restart: up again")
}

// summaryLocked is the count per kind, for the report (in.mu held).
func (in *injector) summaryLocked() string {
	var parts []string
	for _, k := range faultKinds {
		parts = append(parts, fmt.Sprintf("%s %d", k, in.counts[k]))
	}
	return strings.Join(parts, ", ")
}
