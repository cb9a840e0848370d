package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/buzzpg/buzzpg/internal/wsclient"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
)

// FloodLimits are the rate limits the flood scenario starts its "limits on" relay with (the
// BUZZ_* variables of `buzzpg serve`). Victims stay well inside them.
type FloodLimits struct {
	EventRate   float64 `json:"event_rate"`
	EventBurst  int     `json:"event_burst"`
	ReqRate     float64 `json:"req_rate"`
	ReqBurst    int     `json:"req_burst"`
	IPEventRate float64 `json:"ip_event_rate"`
	IPReqRate   float64 `json:"ip_req_rate"`
}

// DefaultFloodLimits: per connection 10 EVENT/s (burst 20) and 10 REQ/s (burst 20); per client IP
// 20 EVENT/s and 10 REQ/s across its connections (the IP buckets take the same bursts). A victim
// connection uses 5 of each per second.
var DefaultFloodLimits = FloodLimits{EventRate: 10, EventBurst: 20, ReqRate: 10, ReqBurst: 20, IPEventRate: 20, IPReqRate: 10}

// Env is the environment of a `buzzpg serve` with these limits.
func (l FloodLimits) Env() []string {
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	return []string{"BUZZ_EVENT_RATE=" + f(l.EventRate), "BUZZ_EVENT_BURST=" + strconv.Itoa(l.EventBurst),
		"BUZZ_REQ_RATE=" + f(l.ReqRate), "BUZZ_REQ_BURST=" + strconv.Itoa(l.ReqBurst),
		"BUZZ_IP_EVENT_RATE=" + f(l.IPEventRate), "BUZZ_IP_REQ_RATE=" + f(l.IPReqRate)}
}

func (l FloodLimits) String() string {
	return fmt.Sprintf("per conn EVENT %g/s burst %d, REQ %g/s burst %d; per IP EVENT %g/s, REQ %g/s",
		l.EventRate, l.EventBurst, l.ReqRate, l.ReqBurst, l.IPEventRate, l.IPReqRate)
}

// NoFloodLimits turns every limit off (rate 0 = unlimited).
var NoFloodLimits = FloodLimits{EventBurst: 100, ReqBurst: 50}

const (
	victimConns   = 8                      // victim connections, each from its own loopback IP (127.0.0.10+i)
	victimTick    = 200 * time.Millisecond // per victim connection: one EVENT and one REQ per tick
	floodConns    = 4                      // flooding connections, all from one client IP
	floodWindow   = 64                     // EVENTs in flight per flooding connection
	floodReqers   = 4                      // concurrent expensive REQs per flooding connection
	floodMaxMsgs  = 2_000_000              // per phase and connection: a count bound beside the time bound
	floodSeed     = 2000                   // kind 1 events the expensive REQ can return
	floodReqLimit = 1000
	replyTimeout  = 10 * time.Second
)

// Flood: the abuse bound of issue 7 part 4. A victim (victimConns connections, each from its own
// loopback IP like separate users, each one EVENT->OK and one small REQ->EOSE per victimTick,
// inside the limits) is measured alone and while one flooding client (floodConns connections from
// another loopback IP, 127.0.0.2, so per-IP limits hit the flooder only) sends EVENTs (floodWindow
// in flight per connection), expensive REQs (kind 1, limit floodReqLimit; floodReqers at a time per
// connection), or both, as fast as it can. With cfg.Spawn it starts two relays of its own: one with
// DefaultFloodLimits and one with no limits (the contrast); without it, only cfg.Relays[0] as
// configured (its NIP-11 limits are shown). Per relay, 3 interleaved rounds of (alone, EVENT flood,
// REQ flood, both), cfg.Duration/3 each (at least 2 s), so a noisy machine hits all alike. The
// headline ratio is the victim's p99 under the full flood over alone with limits on (the larger of
// EVENT->OK and REQ->EOSE).
func Flood(cfg *Config) (*Result, error) {
	f := &flood{cfg: cfg, res: newResult("flood", cfg), rounds: 3, tag: runTag(),
		expensive: nostr.Filter{Kinds: []int{1}, Limit: floodReqLimit}}
	pool, err := openPool(cfg, 4)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	f.chooseAddresses()
	stop, err := f.startTargets()
	defer stop()
	if err != nil {
		return nil, err
	}
	f.seed(pool)
	f.prepare()
	if err := f.measure(); err != nil {
		return nil, err
	}
	f.report()
	return f.res, nil
}

// flood is one run of the flood scenario.
type flood struct {
	cfg       *Config
	res       *Result
	floodIP   string   // "" when 127.0.0.2 cannot be bound
	victimIPs []string // "" each when they cannot be bound
	limits    FloodLimits
	targets   []floodTarget
	phases    map[string]*floodPhase // by target label
	victims   []User
	expensive nostr.Filter
	tag       string // marks this run's seed and flood events
	rounds    int
	slice     time.Duration
}

// floodTarget is one relay measured: "on" (limits), "off" (none) or "as-is" (not spawned).
type floodTarget struct{ label, url, desc string }

// floodMode is what the flooder sends: EVENTs only, expensive REQs only, or both (the headline).
type floodMode struct {
	name         string
	events, reqs bool
}

var floodModes = []floodMode{{"ev-flood", true, false}, {"req-flood", false, true}, {"flood", true, true}}

// floodPhase is what one target's slices add up to. Each relay has its own flood-event set and a
// cursor per connection that carries over slices and rounds.
type floodPhase struct {
	alone  victimStats
	flood  []victimStats // by mode
	fl     []floodStats  // by mode
	evs    [][]*nostr.Event
	cursor [floodConns]int
}

// chooseAddresses gives the flooder and the victims loopback addresses of their own, where the
// host lets us bind them; per-IP limits are off when the flooder cannot have its own.
func (f *flood) chooseAddresses() {
	f.floodIP = "127.0.0.2"
	f.victimIPs = make([]string, victimConns)
	for i := range f.victimIPs {
		f.victimIPs[i] = fmt.Sprintf("127.0.0.%d", 10+i)
	}
	if err := checkLocalIP(f.floodIP); err != nil {
		f.floodIP = ""
		f.victimIPs = make([]string, victimConns)
		f.res.Notes = append(f.res.Notes, fmt.Sprintf("cannot bind 127.0.0.2 (%v): flooder and victims share 127.0.0.1, so per-IP limits are left OFF", err))
	} else if err := checkLocalIP(f.victimIPs[victimConns-1]); err != nil {
		f.victimIPs = make([]string, victimConns)
		f.res.Notes = append(f.res.Notes, fmt.Sprintf("cannot bind %s (%v): victims share 127.0.0.1", f.victimIPs[victimConns-1], err))
	}
	f.limits = DefaultFloodLimits
	if f.floodIP == "" {
		f.limits.IPEventRate, f.limits.IPReqRate = 0, 0
	}
	f.res.Extra["limits"] = f.limits
	f.res.Extra["flood_ip"] = f.floodIP
}

// startTargets spawns a relay with limits and one without, or takes cfg.Relays[0] as it is.
// stop stops what it spawned.
func (f *flood) startTargets() (stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	if f.cfg.Spawn == nil {
		u := f.cfg.Relays[0]
		f.targets = []floodTarget{{"as-is", u, "limits as configured on " + u + ": " + relayLimits(u)}}
		f.res.Notes = append(f.res.Notes, "no --spawn: one relay as configured, no limits-off contrast (use --spawn to get both)")
		return stop, nil
	}
	f.cfg.logf("flood: starting a relay with limits (%s) and one without", f.limits)
	onURL, stopOn, err := f.cfg.Spawn("flood-limits", f.limits.Env())
	if err != nil {
		return stop, err
	}
	stops = append(stops, stopOn)
	offURL, stopOff, err := f.cfg.Spawn("flood-nolimits", NoFloodLimits.Env())
	if err != nil {
		return stop, err
	}
	stops = append(stops, stopOff)
	f.targets = []floodTarget{{"on", onURL, f.limits.String()}, {"off", offURL, "no rate limits"}}
	return stop, nil
}

// seed stores what the expensive REQ returns (setup, not timed).
func (f *flood) seed(pool *pgxpool.Pool) {
	seeder := NewUser()
	tag := f.tag
	pad := strings.Repeat("x", 400)
	seed := split(signParallel(floodSeed, func(i int) *nostr.Event {
		return seeder.Sign(1, nostr.Tags{{"t", "flood-seed-" + tag}}, fmt.Sprintf("seed %s %d %s", tag, i, pad))
	}), 4)
	f.cfg.logf("flood: seeding %d kind 1 events (setup)", floodSeed)
	runWorkers(counts(seed), 0, time.Minute, sqlJob(pool, marshalAll(seed)))
}

// prepare pre-signs the flood events and makes the victims and the phases. Flood events are
// cycled when used up (a resent one is answered duplicate: or rate-limited:). Each relay gets its
// own set, each flooding connection a cursor that carries over the rounds, so the limits-off
// flood sends new events (not duplicates) as long as the set lasts; the limits-on flood mostly
// gets rate-limited: and cycles a smaller set.
func (f *flood) prepare() {
	nFlood := min(max(f.cfg.N, 1000), 20000)
	flooders := make([]User, floodConns)
	for i := range flooders {
		flooders[i] = NewUser()
	}
	tag := f.tag
	nOn := 2000
	f.cfg.logf("flood: pre-signing %d + %d flood events", nOn, nFlood)
	floodSet := func(n int, what string) [][]*nostr.Event {
		return split(signParallel(n, func(i int) *nostr.Event {
			return flooders[i%floodConns].Sign(1, nostr.Tags{{"t", "flood-" + tag}}, fmt.Sprintf("flood %s %s %d", what, tag, i))
		}), floodConns)
	}
	onEvs, offEvs := floodSet(nOn, "on"), floodSet(nFlood, "off")
	f.victims = make([]User, victimConns)
	for i := range f.victims {
		f.victims[i] = NewUser()
	}
	f.phases = map[string]*floodPhase{}
	for _, t := range f.targets {
		ph := &floodPhase{evs: offEvs, flood: make([]victimStats, len(floodModes)), fl: make([]floodStats, len(floodModes))}
		if t.label == "on" {
			ph.evs = onEvs
		}
		f.phases[t.label] = ph
	}
	f.slice = max(f.cfg.Duration/time.Duration(f.rounds), 2*time.Second)
}

// measure runs interleaved slices (alone, then each flood, per target, round after round) so the
// noise of a shared machine falls on both sides of each ratio alike.
func (f *flood) measure() error {
	for r := 0; r < f.rounds; r++ {
		for _, t := range f.targets {
			ph := f.phases[t.label]
			f.cfg.logf("flood: round %d/%d [limits %s] victim alone, then under each flood (%s slices)", r+1, f.rounds, t.label, f.slice)
			if err := runVictims(&ph.alone, t.url, f.victims, f.victimIPs, f.slice); err != nil {
				return err
			}
			for m, md := range floodModes {
				if err := f.floodSlice(t.url, ph, m, md); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// floodSlice measures the victim for one slice while the flooder sends mode md.
func (f *flood) floodSlice(url string, ph *floodPhase, m int, md floodMode) error {
	time.Sleep(300 * time.Millisecond)
	stop := make(chan struct{})
	var fwg sync.WaitGroup
	floodStart := time.Now()
	floodDeadline := floodStart.Add(f.slice + 500*time.Millisecond)
	fl := &ph.fl[m]
	for i := 0; i < floodConns; i++ {
		fwg.Add(1)
		go func(i int) {
			defer fwg.Done()
			fl.run(url, f.floodIP, ph.evs[i], &ph.cursor[i], md, f.expensive, floodDeadline, stop)
		}(i)
	}
	time.Sleep(500 * time.Millisecond) // the flood is on before the victim starts
	verr := runVictims(&ph.flood[m], url, f.victims, f.victimIPs, f.slice)
	close(stop)
	fwg.Wait()
	fl.secs += time.Since(floodStart).Seconds()
	if verr != nil {
		return verr
	}
	time.Sleep(700 * time.Millisecond) // let the relay drain before the next slice
	return nil
}

// floodWorst compares the victim under a flood with the victim alone.
type floodWorst struct {
	ratio, evP99, reqP99, evP50x, reqP50x float64
	ev, rq                                float64
}

func summarizeFlood(alone, fl *victimStats) floodWorst {
	ea, ra, ef, rf := alone.ev.Summary(), alone.req.Summary(), fl.ev.Summary(), fl.req.Summary()
	w := floodWorst{ev: ratio(ef.P99ms, ea.P99ms), rq: ratio(rf.P99ms, ra.P99ms), evP99: ef.P99ms, reqP99: rf.P99ms,
		evP50x: ratio(ef.P50ms, ea.P50ms), reqP50x: ratio(rf.P50ms, ra.P50ms)}
	w.ratio = max(w.ev, w.rq)
	return w
}

// report writes the rows and notes: per target, the headline, then how the run was made.
func (f *flood) report() {
	for _, t := range f.targets {
		f.reportTarget(t)
	}
	f.reportHeadline()
	f.reportSetup()
}

// reportTarget adds a target's rows, ratios and summary line.
func (f *flood) reportTarget(t floodTarget) {
	res, ph := f.res, f.phases[t.label]
	res.Rows = append(res.Rows, ph.alone.rows(t.label+"/alone")...)
	line := fmt.Sprintf("limits %s (%s): victim alone p99 EVENT->OK %.2f ms, REQ->EOSE %.2f ms; p99 under flood / alone:",
		t.label, t.desc, ph.alone.ev.Summary().P99ms, ph.alone.req.Summary().P99ms)
	for m, md := range floodModes {
		res.Rows = append(res.Rows, ph.flood[m].rows(t.label+"/"+md.name)...)
		frows := ph.fl[m].rows(t.label + "/" + md.name)
		if md.events {
			res.Rows = append(res.Rows, frows[0])
		}
		if md.reqs {
			res.Rows = append(res.Rows, frows[1])
		}
		w := summarizeFlood(&ph.alone, &ph.flood[m])
		res.Extra[fmt.Sprintf("p99_ratio_event_%s_%s", md.name, t.label)] = w.ev
		res.Extra[fmt.Sprintf("p99_ratio_req_%s_%s", md.name, t.label)] = w.rq
		res.Extra[fmt.Sprintf("flooder_rate_limited_%s_%s", md.name, t.label)] = ph.fl[m].evReplies.Map()["rate-limited"] + ph.fl[m].reqReplies.Map()["rate-limited"]
		line += fmt.Sprintf(" [%s] EVENT->OK %.2f ms = %.1fx, REQ->EOSE %.2f ms = %.1fx (p50 %.1fx, %.1fx);", md.name, w.evP99, w.ev, w.reqP99, w.rq, w.evP50x, w.reqP50x)
	}
	res.Notes = append(res.Notes, strings.TrimSuffix(line, ";"))
}

// reportHeadline sets the ratio: the full flood against the first target (limits on), and the
// limits-off contrast.
func (f *flood) reportHeadline() {
	res, both := f.res, len(floodModes)-1
	head := f.targets[0].label
	hw := summarizeFlood(&f.phases[head].alone, &f.phases[head].flood[both])
	res.Ratio = hw.ratio
	res.RatioWhat = fmt.Sprintf("victim p99 under flood (EVENTs + expensive REQs) / alone, limits %s (the larger of EVENT->OK and REQ->EOSE)", head)
	fl := &f.phases[head].fl[both]
	res.Notes = append(res.Notes, fmt.Sprintf("bound (this run, limits %s): victim p99 under flood <= %.1fx alone (EVENT->OK p99 %.2f ms, REQ->EOSE p99 %.2f ms under flood); the flooder got %d rate-limited: OKs and %d rate-limited: CLOSEDs",
		head, hw.ratio, hw.evP99, hw.reqP99, fl.evReplies.Map()["rate-limited"], fl.reqReplies.Map()["rate-limited"]))
	if off, ok := f.phases["off"]; ok {
		ow := summarizeFlood(&off.alone, &off.flood[both])
		res.Notes = append(res.Notes, fmt.Sprintf("contrast, limits off: victim p99 under the same flood <= %.1fx alone (EVENT->OK p99 %.2f ms, REQ->EOSE p99 %.2f ms)",
			ow.ratio, ow.evP99, ow.reqP99))
	}
}

// reportSetup says who sent what, from where.
func (f *flood) reportSetup() {
	vfrom := "127.0.0.1"
	if f.victimIPs[0] != "" {
		vfrom = fmt.Sprintf("%s..%s (one IP each)", f.victimIPs[0], f.victimIPs[victimConns-1])
	}
	f.res.Notes = append(f.res.Notes, fmt.Sprintf("victim: %d connections from %s, each one kind 1 EVENT->OK and one REQ {authors:[self],kinds:[1],limit:5}->EOSE per %s (missed ticks are skipped, not caught up)",
		victimConns, vfrom, victimTick))
	from := f.floodIP
	if from == "" {
		from = "127.0.0.1"
	}
	f.res.Notes = append(f.res.Notes, fmt.Sprintf("flooder: %d connections from %s, each %d EVENTs in flight (pre-signed kind 1, cycled when used up) and %d concurrent REQ {kinds:[1],limit:%d} (%d seeded events of ~450 B) as fast as replies come; %d rounds of (alone, EVENT flood, REQ flood, both) per relay, interleaved, %s each; the flood starts 0.5 s before the victim",
		floodConns, from, floodWindow, floodReqers, floodReqLimit, floodSeed, f.rounds, f.slice))
	f.res.Notes = append(f.res.Notes, "bench client, relays and PostgreSQL share this machine: under flood the victim also competes for CPU with the flooding client itself")
}

// checkLocalIP tells whether this host can bind ip (Linux routes 127/8 to lo).
func checkLocalIP(ip string) error {
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.ParseIP(ip)})
	if err != nil {
		return err
	}
	return l.Close()
}

// relayLimits reads the rate limits advertised in a relay's NIP-11 limitation object.
func relayLimits(wsURL string) string {
	req, _ := http.NewRequest("GET", strings.TrimRight(HTTPOf(wsURL), "/")+"/", nil)
	req.Header.Set("Accept", "application/nostr+json")
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	defer resp.Body.Close()
	var doc struct {
		Limitation map[string]any `json:"limitation"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return "unknown"
	}
	var parts []string
	for _, k := range []string{"event_rate_per_second", "event_burst", "req_rate_per_second", "req_burst", "ip_event_rate_per_second", "ip_req_rate_per_second"} {
		if v, ok := doc.Limitation[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	if len(parts) == 0 {
		return "none advertised"
	}
	return strings.Join(parts, " ")
}

type victimStats struct {
	ev, req         Latencies
	evErrs, reqErrs Errors
	secs            float64
}

func (v *victimStats) rows(label string) []Row {
	ev, rq := v.ev.Summary(), v.req.Summary()
	return []Row{
		{Name: label + ": victim EVENT->OK", Conns: victimConns, Count: ev.N, Seconds: v.secs, Rate: float64(ev.N) / v.secs, Latency: ev, Errors: v.evErrs.Map()},
		{Name: label + ": victim REQ->EOSE", Conns: victimConns, Count: rq.N, Seconds: v.secs, Rate: float64(rq.N) / v.secs, Latency: rq, Errors: v.reqErrs.Map()},
	}
}

// runVictims runs the victim connections against url for dur, connection i from ips[i] ("" = any),
// adding to v.
func runVictims(v *victimStats, url string, users []User, ips []string, dur time.Duration) error {
	cs := make([]*wsclient.Client, len(users))
	defer closeAll(cs)
	for i := range cs {
		c, err := wsclient.DialFrom(url, ips[i], wsclient.Handlers{}, 10*time.Second)
		if err != nil {
			return fmt.Errorf("victim connect %s from %q: %w", url, ips[i], err)
		}
		cs[i] = c
	}
	start := time.Now()
	deadline := start.Add(dur)
	maxIters := int(dur/victimTick) + 1
	var wg sync.WaitGroup
	for i := range cs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c, u := cs[i], users[i]
			f := nostr.Filter{Authors: []string{u.PK}, Kinds: []int{1}, Limit: 5}
			// Stagger the connections over one tick.
			next := start.Add(time.Duration(i) * victimTick / time.Duration(len(cs)))
			time.Sleep(time.Until(next))
			for k := 0; k < maxIters && time.Now().Before(deadline); k++ {
				ev := u.Sign(1, nostr.Tags{{"t", "victim"}}, "")
				t0 := time.Now()
				o, err := c.Publish(ev, replyTimeout)
				switch {
				case err != nil:
					v.ev.Add(time.Since(t0))
					v.evErrs.Add(errClass(err))
					if errors.Is(err, wsclient.ErrClosed) {
						return
					}
				default:
					v.ev.Add(o.At.Sub(t0))
					if !o.OK {
						v.evErrs.Add(o.Msg)
					}
				}
				sub := "v" + strconv.Itoa(k)
				t1 := time.Now()
				err = c.Req(sub, replyTimeout, f)
				v.req.Add(time.Since(t1))
				if err != nil {
					v.reqErrs.Add(errClass(err))
					if errors.Is(err, wsclient.ErrClosed) {
						return
					}
				}
				_ = c.CloseSub(sub)
				next = next.Add(victimTick)
				if d := time.Until(next); d > 0 {
					time.Sleep(d)
				} else {
					next = time.Now() // behind: skip the missed ticks instead of bursting
				}
			}
		}(i)
	}
	wg.Wait()
	v.secs += time.Since(start).Seconds()
	return nil
}

// errClass turns a Req/Publish error into an Errors key: a CLOSED reason's prefix
// ("rate-limited: ..."), "timeout" or "closed".
func errClass(err error) string {
	switch {
	case errors.Is(err, wsclient.ErrTimeout):
		return "timeout"
	case errors.Is(err, wsclient.ErrClosed):
		return "closed"
	}
	var closed *wsclient.ClosedError
	if errors.As(err, &closed) {
		return closed.Reason
	}
	return "error: " + err.Error()
}

// floodStats is what the flooding connections did, summed.
type floodStats struct {
	evSent, reqSent   atomic.Int64
	evReplies         Errors // "ok" or the OK prefix
	reqReplies        Errors // "eose" or the CLOSED prefix, "timeout", "closed"
	rxEvents, rxBytes atomic.Int64
	redials           atomic.Int64
	secs              float64 // summed over the flood slices (set by Flood)
}

func (f *floodStats) rows(label string) []Row {
	secs := f.secs
	if secs <= 0 {
		secs = 1
	}
	ev, rq := f.evReplies.Map(), f.reqReplies.Map()
	evN, rqN := int(f.evSent.Load()), int(f.reqSent.Load())
	return []Row{
		{Name: label + ": flooder EVENT", Conns: floodConns, Count: evN, Seconds: secs, Rate: float64(evN) / secs, Errors: ev,
			Note: fmt.Sprintf("EVENTs sent; replies by class (ok = accepted); %.1f accepted/s; %d redials", float64(ev["ok"])/secs, f.redials.Load())},
		{Name: label + ": flooder REQ", Conns: floodConns, Count: rqN, Seconds: secs, Rate: float64(rqN) / secs, Errors: rq,
			Note: fmt.Sprintf("expensive REQs sent; eose = answered in full; %d events / %.1f MB received", f.rxEvents.Load(), float64(f.rxBytes.Load())/1e6)},
	}
}

// run is one flooding connection until deadline or stop: EVENTs with floodWindow in flight, and
// floodReqers loops of expensive REQ (then CLOSE), as md says. It redials (at most 20 times) if
// the relay drops it.
func (f *floodStats) run(url, localIP string, evs []*nostr.Event, cursor *int, md floodMode, expensive nostr.Filter, deadline time.Time, stop <-chan struct{}) {
	fc := &floodConn{f: f, evs: evs, idx: *cursor, md: md, expensive: expensive, deadline: deadline, stop: stop}
	defer func() { *cursor = fc.idx }()
	for dial := 0; dial <= 20; dial++ {
		select {
		case <-stop:
			return
		default:
		}
		if time.Now().After(deadline) || fc.sent >= floodMaxMsgs {
			return
		}
		if dial > 0 {
			f.redials.Add(1)
			time.Sleep(50 * time.Millisecond)
		}
		c, sem, err := f.dial(url, localIP)
		if err != nil {
			continue
		}
		if !fc.flood(c, sem) {
			return
		}
	}
}

// floodConn is one flooding connection's state across its redials.
type floodConn struct {
	f         *floodStats
	evs       []*nostr.Event
	idx, sent int
	md        floodMode
	expensive nostr.Filter
	deadline  time.Time
	stop      <-chan struct{}
}

// dial connects a flooding connection whose OKs free a place in sem and are counted by class.
func (f *floodStats) dial(url, localIP string) (*wsclient.Client, chan struct{}, error) {
	sem := make(chan struct{}, floodWindow)
	c, err := wsclient.DialFrom(url, localIP, wsclient.Handlers{
		OnOK: func(o wsclient.OK) {
			select {
			case <-sem:
			default:
			}
			switch {
			case o.OK && strings.HasPrefix(o.Msg, "duplicate:"):
				f.evReplies.Add("duplicate")
			case o.OK:
				f.evReplies.Add("ok")
			default:
				f.evReplies.Add(o.Msg)
			}
		},
		OnRawEvent: func(_ string, raw []byte, _ time.Time) {
			f.rxEvents.Add(1)
			f.rxBytes.Add(int64(len(raw)))
		},
	}, 10*time.Second)
	return c, sem, err
}

// flood floods on c until the deadline, stop, or the relay drops it; it reports whether the
// relay dropped it before the deadline (redial).
func (fc *floodConn) flood(c *wsclient.Client, sem chan struct{}) (dropped bool) {
	var wg sync.WaitGroup
	for r := 0; r < floodReqers && fc.md.reqs; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			fc.reqLoop(c, r)
		}(r)
	}
	if fc.md.events {
		fc.sendEvents(c, sem)
	}
	if !fc.md.events || fc.sent >= floodMaxMsgs {
		// No EVENTs, or the count bound came first: keep the REQ loops going until the
		// deadline or stop.
		select {
		case <-fc.stop:
		case <-time.After(time.Until(fc.deadline)):
		case <-c.Done():
		}
	}
	select {
	case <-c.Done():
		dropped = time.Now().Before(fc.deadline)
	default:
	}
	c.Close()
	wg.Wait()
	return dropped
}

// sendEvents sends EVENTs with floodWindow in flight until the deadline, stop, a drop or the count bound.
func (fc *floodConn) sendEvents(c *wsclient.Client, sem chan struct{}) {
	timer := time.NewTimer(time.Until(fc.deadline))
	defer timer.Stop()
	for fc.sent < floodMaxMsgs {
		select {
		case sem <- struct{}{}:
		case <-fc.stop:
			return
		case <-timer.C:
			return
		case <-c.Done():
			return
		}
		if err := c.Send(fc.evs[fc.idx%len(fc.evs)]); err != nil {
			return
		}
		fc.idx++
		fc.sent++
		fc.f.evSent.Add(1)
	}
}

// reqLoop is one of the floodReqers loops of expensive REQ then CLOSE.
func (fc *floodConn) reqLoop(c *wsclient.Client, r int) {
	f := fc.f
	for k := 0; k < floodMaxMsgs; k++ {
		select {
		case <-fc.stop:
			return
		case <-c.Done():
			return
		default:
		}
		if time.Now().After(fc.deadline) {
			return
		}
		sub := fmt.Sprintf("f%d-%d", r, k)
		f.reqSent.Add(1)
		err := c.Req(sub, replyTimeout, fc.expensive)
		if err == nil {
			f.reqReplies.Add("eose")
		} else {
			f.reqReplies.Add(errClass(err))
			if errors.Is(err, wsclient.ErrClosed) {
				return
			}
		}
		_ = c.CloseSub(sub)
	}
}
