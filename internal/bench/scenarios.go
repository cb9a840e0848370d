package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/buzzpg/buzzpg/internal/wsclient"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"
)

func runTag() string { return strconv.FormatInt(time.Now().UnixNano()%1e12, 36) }

func newResult(name string, cfg *Config) *Result {
	return &Result{Scenario: name, Started: time.Now(), Relays: cfg.Relays, Extra: map[string]any{}}
}

// Ingest: kind 1 events, pre-signed, published closed loop (one EVENT in flight per connection)
// from cfg.Conns connections spread over the relays. Baseline: buzz.accept_event called from Go
// on cfg.Conns pool connections with a second set of pre-signed events of the same shape.
func Ingest(cfg *Config) (*Result, error) {
	res := newResult("ingest", cfg)
	n := cfg.N
	if cfg.Rate > 0 && int(cfg.Rate*cfg.Duration.Seconds()) < n {
		n = int(cfg.Rate * cfg.Duration.Seconds())
	}
	tag := runTag()
	users := make([]User, cfg.Conns)
	for i := range users {
		users[i] = NewUser()
	}
	mk := func(prefix string) [][]*nostr.Event {
		flat := signParallel(n, func(i int) *nostr.Event {
			return users[i%cfg.Conns].Sign(1, nostr.Tags{{"t", "bench-" + tag}}, fmt.Sprintf("%s %s %d", prefix, tag, i))
		})
		return split(flat, cfg.Conns)
	}
	cfg.logf("ingest: pre-signing %d + %d events", n, n)
	relayEvs, sqlEvs := mk("relay"), mk("sql")

	cs, err := dialAll(cfg.Relays, cfg.Conns, nil, nil)
	if err != nil {
		return nil, err
	}
	cfg.logf("ingest: relay run (%d conns, %s)", cfg.Conns, cfg.Duration)
	row := runWorkers(counts(relayEvs), cfg.Rate, cfg.Duration, publishJob(cs, relayEvs))
	closeAll(cs)
	row.Name, row.Conns = "kind 1 via relay", cfg.Conns
	res.Rows = append(res.Rows, row)
	if cfg.NoBaseline {
		return res, nil
	}

	pool, err := openPool(cfg, cfg.Conns)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	cfg.logf("ingest: SQL baseline (%d conns)", cfg.Conns)
	base := runWorkers(counts(sqlEvs), cfg.Rate, cfg.Duration, sqlJob(pool, marshalAll(sqlEvs)))
	base.Name, base.Conns, base.Baseline = "buzz.accept_event kind 1", cfg.Conns, true
	res.Rows = append(res.Rows, base)
	res.Ratio = ratio(row.Rate, base.Rate)
	res.RatioWhat = fmt.Sprintf("relay rate / accept_event rate, both with %d concurrent connections", cfg.Conns)
	return res, nil
}

// DM: kind 9 messages in DMs. "hot": nobody hides (the path every chat message takes). "mix":
// per DM a repeating cycle of 10 events: 2 hides (41012), 2 messages that resurface the other
// member's hide, 6 plain messages. "resurface": per DM, B hides (41012) then A sends a kind 9,
// over and over, so every message clears a hide (generation bump, outbox upsert, NOTIFY, and a
// 30622 for the listeners to publish); the figure is messages per second (the hides are not
// counted; the total event rate is twice it). Each DM's events go in order through one connection.
// Baseline: the same shapes on other DMs through buzz.accept_event on as many pool connections.
func DM(cfg *Config) ([]*Result, error) {
	pool, err := openPool(cfg, cfg.Conns+2)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	np := cfg.Conns * dmPairsPerWorker
	cfg.logf("dm: opening %d DMs (setup)", 6*np)
	sets := make([][]dmPair, 6)
	for i := range sets {
		if sets[i], err = openPairs(pool, np); err != nil {
			return nil, err
		}
	}
	perWorker := max(cfg.N/cfg.Conns, 10)
	units := perWorker / 2
	cfg.logf("dm: pre-signing %d events", 6*perWorker*cfg.Conns)
	hotR, hotS := dmSequences(cfg.Conns, sets[0], perWorker, false), dmSequences(cfg.Conns, sets[1], perWorker, false)
	mixR, mixS := dmSequences(cfg.Conns, sets[2], perWorker, true), dmSequences(cfg.Conns, sets[3], perWorker, true)
	resR, resS := dmResurfaceSequences(cfg.Conns, sets[4], units), dmResurfaceSequences(cfg.Conns, sets[5], units)

	hot, err := dmRun(cfg, pool, "dm-hot", hotR, hotS, "kind 9, no hides")
	if err != nil {
		return nil, err
	}
	mix, err := dmRun(cfg, pool, "dm-mix", mixR, mixS, "20% hide, 20% resurfacing")
	if err != nil {
		return nil, err
	}
	mix.Notes = append(mix.Notes, "mix: per DM a cycle of 10 events (2 hides, 2 resurfacing messages, 6 plain); every hide and resurfacing message also makes the listeners publish a 30622")

	res, err := dmResurface(cfg, pool, resR, resS, units)
	if err != nil {
		return nil, err
	}
	hot.Notes = append(hot.Notes, fmt.Sprintf("issue 4 target: hot path >= 50%% of the raw accept_event rate: %.0f%% (%s)",
		100*hot.Ratio, map[bool]string{true: "met", false: "NOT met"}[hot.Ratio >= 0.5]))
	if len(hot.Rows) > 1 && len(res.Rows) > 1 {
		res.Extra["msg_rate_vs_hot_sql"] = ratio(res.Rows[0].Rate, hot.Rows[1].Rate)
		res.Notes = append(res.Notes, fmt.Sprintf("resurfacing messages via relay / hot-path accept_event rate (kind 9, no hides) = %.3f",
			ratio(res.Rows[0].Rate, hot.Rows[1].Rate)))
	}
	return []*Result{hot, mix, res}, nil
}

// dmPairsPerWorker is how many DMs each worker of the dm scenario interleaves.
const dmPairsPerWorker = 2

// signPerWorker signs each of conns workers' sequences in parallel.
func signPerWorker(conns int, sign func(w int) []*nostr.Event) [][]*nostr.Event {
	out := make([][]*nostr.Event, conns)
	var wg sync.WaitGroup
	for w := 0; w < conns; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			out[w] = sign(w)
		}(w)
	}
	wg.Wait()
	return out
}

// dmSequences gives worker w n events on its pairs w*dmPairsPerWorker.., interleaved: messages
// both ways, and with mix a hide by each side in every cycle of 10.
func dmSequences(conns int, pairs []dmPair, n int, mix bool) [][]*nostr.Event {
	return signPerWorker(conns, func(w int) []*nostr.Event {
		var evs []*nostr.Event
		for k := 0; k < n; k++ {
			p := pairs[w*dmPairsPerWorker+k%dmPairsPerWorker]
			step := (k / dmPairsPerWorker) % 10
			h := nostr.Tags{{"h", p.Ch}}
			switch {
			case mix && step == 0:
				evs = append(evs, p.B.Sign(41012, h, ""))
			case mix && step == 5:
				evs = append(evs, p.A.Sign(41012, h, ""))
			case step%2 == 1:
				evs = append(evs, p.A.Sign(9, h, "hello "+strconv.Itoa(k)))
			default:
				evs = append(evs, p.B.Sign(9, h, "hi "+strconv.Itoa(k)))
			}
		}
		return evs
	})
}

// dmResurfaceSequences: per unit k of worker w, on pair w*dmPairsPerWorker+k%dmPairsPerWorker, B
// hides and then A sends a message, which clears that hide: every message resurfaces the DM for B.
func dmResurfaceSequences(conns int, pairs []dmPair, units int) [][]*nostr.Event {
	return signPerWorker(conns, func(w int) []*nostr.Event {
		var evs []*nostr.Event
		for k := 0; k < units; k++ {
			p := pairs[w*dmPairsPerWorker+k%dmPairsPerWorker]
			h := nostr.Tags{{"h", p.Ch}}
			evs = append(evs, p.B.Sign(41012, h, ""), p.A.Sign(9, h, "back "+strconv.Itoa(k)))
		}
		return evs
	})
}

// dmRun publishes relayEvs through the relays, then accepts sqlEvs in SQL on as many connections.
func dmRun(cfg *Config, pool *pgxpool.Pool, name string, relayEvs, sqlEvs [][]*nostr.Event, what string) (*Result, error) {
	res := newResult(name, cfg)
	cs, err := dialAll(cfg.Relays, cfg.Conns, nil, nil)
	if err != nil {
		return nil, err
	}
	cfg.logf("%s: relay run", name)
	row := runWorkers(counts(relayEvs), cfg.Rate, cfg.Duration, publishJob(cs, relayEvs))
	closeAll(cs)
	row.Name, row.Conns = what+" via relay", cfg.Conns
	cfg.logf("%s: SQL baseline", name)
	base := runWorkers(counts(sqlEvs), cfg.Rate, cfg.Duration, sqlJob(pool, marshalAll(sqlEvs)))
	base.Name, base.Conns, base.Baseline = "buzz.accept_event "+what, cfg.Conns, true
	res.Rows = append(res.Rows, row, base)
	res.Ratio = ratio(row.Rate, base.Rate)
	res.RatioWhat = fmt.Sprintf("relay rate / accept_event rate, both with %d concurrent connections", cfg.Conns)
	return res, nil
}

// dmResurface runs the "every message resurfaces someone" DM run: evs[w] is (hide, message)
// repeated; one unit publishes both in order and is timed by its message. Rates count messages.
func dmResurface(cfg *Config, pool *pgxpool.Pool, relayEvs, sqlEvs [][]*nostr.Event, units int) (*Result, error) {
	res := newResult("dm-resurface", cfg)
	perWorker := make([]int, cfg.Conns)
	for i := range perWorker {
		perWorker[i] = units
	}
	rate := cfg.Rate / 2 // --rate is events per second; a unit is two events
	var relayHides, sqlHides Latencies
	var relayHideErrs, sqlHideErrs Errors
	pair := func(one job, hideLat *Latencies, hideErrs *Errors) job {
		return func(w, k int) (time.Duration, string, bool) {
			lat, msg, more := one(w, 2*k)
			if !more {
				return lat, msg, false
			}
			hideLat.Add(lat)
			if msg != "" {
				hideErrs.Add(msg)
			}
			return one(w, 2*k+1)
		}
	}
	cs, err := dialAll(cfg.Relays, cfg.Conns, nil, nil)
	if err != nil {
		return nil, err
	}
	cfg.logf("dm-resurface: relay run")
	row := runWorkers(perWorker, rate, cfg.Duration, pair(publishJob(cs, relayEvs), &relayHides, &relayHideErrs))
	closeAll(cs)
	row.Name, row.Conns = "kind 9 resurfacing via relay", cfg.Conns
	row.Note = fmt.Sprintf("messages/s, each after a hide 41012 on its DM: %.1f events/s in all; hide p50 %.2f ms p99 %.2f ms, hide errors %s",
		2*row.Rate, relayHides.Summary().P50ms, relayHides.Summary().P99ms, fmtErrors(relayHideErrs.Map()))
	cfg.logf("dm-resurface: SQL baseline")
	base := runWorkers(perWorker, rate, cfg.Duration, pair(sqlJob(pool, marshalAll(sqlEvs)), &sqlHides, &sqlHideErrs))
	base.Name, base.Conns, base.Baseline = "buzz.accept_event hide+resurface", cfg.Conns, true
	base.Note = fmt.Sprintf("messages/s of the same sequence on other DMs: %.1f events/s in all; hide p50 %.2f ms p99 %.2f ms, hide errors %s",
		2*base.Rate, sqlHides.Summary().P50ms, sqlHides.Summary().P99ms, fmtErrors(sqlHideErrs.Map()))
	res.Rows = append(res.Rows, row, base)
	res.Ratio = ratio(row.Rate, base.Rate)
	res.RatioWhat = fmt.Sprintf("relay message rate / accept_event message rate (same hide+message sequence), both with %d concurrent connections", cfg.Conns)
	res.Extra["events_per_s_relay"] = 2 * row.Rate
	res.Extra["events_per_s_sql"] = 2 * base.Rate
	res.Notes = append(res.Notes, "every message clears the recipient's hide: generation bump + outbox upsert + NOTIFY, and the listeners publish 30622s meanwhile (relay run only; in the SQL run the relays' listeners publish too)")
	return res, nil
}

// snapSink collects one viewer's live 30622 snapshots (hidden channel sets).
type snapSink struct {
	ch chan snapRecv
}

type snapRecv struct {
	hidden map[string]bool
	at     time.Time
}

func (s *snapSink) wait(pred func(map[string]bool) bool, timeout time.Duration) (time.Time, bool) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		select {
		case r := <-s.ch:
			if pred(r.hidden) {
				return r.at, true
			}
		case <-t.C:
			return time.Time{}, false
		}
	}
}

func hiddenSet(ev *nostr.Event) map[string]bool {
	m := map[string]bool{}
	for _, t := range ev.Tags {
		if len(t) >= 2 && t[0] == "h" {
			m[t[1]] = true
		}
	}
	return m
}

// Converge: a viewer hides its DM and waits for its snapshot to list it; then the other member
// sends a message (which resurfaces the DM for the viewer) and we measure from that message's OK
// to the viewer's live 30622 without the DM. Viewers read on the first relay, senders publish on
// the last (another process when there are two). cfg.Conns pairs run concurrently.
// Baseline (needs --relay-key): the same chain done directly in SQL from Go: accept_event(message),
// buzz.visibility_source, sign, buzz.publish_visibility_snapshot -- the listener's work without
// queueing, replication and the WebSocket hops; one pool connection per pair.
func Converge(cfg *Config) (*Result, error) {
	c := &converge{cfg: cfg, res: newResult("converge", cfg), k: cfg.Conns}
	var err error
	if c.relayPK, err = RelayPubkey(cfg.Relays[0]); err != nil {
		return nil, err
	}
	if c.pool, err = openPool(cfg, cfg.Conns+2); err != nil {
		return nil, err
	}
	defer c.pool.Close()
	if c.pairs, err = openPairs(c.pool, c.k); err != nil {
		return nil, err
	}
	defer c.close()
	if err := c.connect(); err != nil {
		return nil, err
	}
	c.pace()
	row := c.relayRun()
	if cfg.RelayKey == "" {
		c.res.Notes = append(c.res.Notes, "no --relay-key: SQL baseline skipped")
		return c.res, nil
	}
	base, err := c.baseline()
	if err != nil {
		return nil, err
	}
	c.res.Rows = append(c.res.Rows, base)
	c.res.Ratio = ratio(row.Latency.P50ms, base.Latency.P50ms)
	c.res.RatioWhat = "relay p50 (message OK -> live snapshot) / SQL p50 (accept message -> snapshot published)"
	return c.res, nil
}

// converge is one run of the converge scenario: k pairs, each a viewer (B) subscribed to its
// snapshots and a sender (A) whose message resurfaces the DM the viewer hid.
type converge struct {
	cfg              *Config
	res              *Result
	relayPK          string
	pool             *pgxpool.Pool
	k                int
	pairs            []dmPair
	sinks            []*snapSink
	viewers, senders []*wsclient.Client
	perWorker        []int
	rate             float64
}

func (c *converge) close() {
	closeAll(c.senders)
	closeAll(c.viewers)
}

// connect dials the viewers (on the first relay, subscribed to their snapshots) and the senders
// (on the last).
func (c *converge) connect() (err error) {
	c.sinks = make([]*snapSink, c.k)
	for i := range c.sinks {
		c.sinks[i] = &snapSink{ch: make(chan snapRecv, 4096)}
	}
	c.viewers, err = dialAll(c.cfg.Relays[:1], c.k, func(i int) string { return c.pairs[i].B.SK }, func(i int) wsclient.Handlers {
		return wsclient.Handlers{OnEvent: func(sub string, ev *nostr.Event, at time.Time) {
			if ev.Kind == 30622 {
				select {
				case c.sinks[i].ch <- snapRecv{hiddenSet(ev), at}:
				default:
				}
			}
		}}
	})
	if err != nil {
		return err
	}
	if c.senders, err = dialAll(c.cfg.Relays[len(c.cfg.Relays)-1:], c.k, nil, nil); err != nil {
		return err
	}
	for i, v := range c.viewers {
		f := nostr.Filter{Kinds: []int{30622}, Authors: []string{c.relayPK}, Tags: nostr.TagMap{"p": {c.pairs[i].B.PK}}}
		if err := v.Req("snap", 10*time.Second, f); err != nil {
			return err
		}
	}
	return nil
}

// pace sets the rounds per pair and the rate. A viewer's snapshots need strictly increasing
// created_at at most 10 s ahead of the clock (docs/protocol.md), so one viewer sustains about
// one snapshot per second; each round trip makes two. Unless --rate says otherwise, pace every
// pair to one round trip per 2.2 s so the figure is the pipeline's latency, not the clock's.
func (c *converge) pace() {
	iters := max(c.cfg.N/c.k, 1)
	c.rate = c.cfg.Rate
	if c.rate <= 0 {
		c.rate = float64(c.k) / 2.2
	}
	c.perWorker = make([]int, c.k)
	for i := range c.perWorker {
		c.perWorker[i] = iters
	}
}

// relayRun measures hide -> snapshot, then message -> resurfaced snapshot, through the relays.
func (c *converge) relayRun() Row {
	var hideLat Latencies
	var hideErrs Errors
	c.cfg.logf("converge: %d pairs, relay run", c.k)
	row := runWorkers(c.perWorker, c.rate, c.cfg.Duration, func(w, it int) (time.Duration, string, bool) {
		p, s := c.pairs[w], c.sinks[w]
		hide := p.B.Sign(41012, nostr.Tags{{"h", p.Ch}}, "")
		o, err := c.viewers[w].Publish(hide, 30*time.Second)
		if err != nil || !o.OK {
			hideErrs.Add(fmt.Sprintf("%v%s", err, o.Msg))
			return 0, "hide failed", false
		}
		at, ok := s.wait(func(h map[string]bool) bool { return h[p.Ch] }, 30*time.Second)
		if !ok {
			hideErrs.Add("timeout: no snapshot with the hide")
			return 0, "timeout: hide snapshot", true
		}
		hideLat.Add(at.Sub(o.At))
		msg := p.A.Sign(9, nostr.Tags{{"h", p.Ch}}, "resurface "+strconv.Itoa(it))
		o, err = c.senders[w].Publish(msg, 30*time.Second)
		if err != nil || !o.OK {
			return 0, fmt.Sprintf("%v%s", err, o.Msg), err == nil
		}
		at, ok = s.wait(func(h map[string]bool) bool { return !h[p.Ch] }, 30*time.Second)
		if !ok {
			return 30 * time.Second, "timeout: no resurfaced snapshot", true
		}
		return max(at.Sub(o.At), 0), "", true
	})
	row.Name, row.Conns = "message OK -> live 30622", c.k
	row.Note = fmt.Sprintf("paced to %.1f round trips/s in all (hide, its snapshot, message, its snapshot); a viewer sustains ~1 snapshot/s", c.rate)
	hs := hideLat.Summary()
	c.res.Rows = append(c.res.Rows, row, Row{Name: "hide OK -> live 30622", Conns: c.k, Count: hs.N, Latency: hs, Errors: hideErrs.Map()})
	return row
}

// baseline is the same chain in SQL on fresh pairs: accept the hide, then accept the message
// and source, sign and publish the snapshot in one transaction.
func (c *converge) baseline() (Row, error) {
	bpairs, err := openPairs(c.pool, c.k)
	if err != nil {
		return Row{}, err
	}
	c.cfg.logf("converge: SQL baseline")
	var stale, retries atomic.Int64
	var accLat, pubLat Latencies
	base := runWorkers(c.perWorker, c.rate, c.cfg.Duration, func(w, it int) (time.Duration, string, bool) {
		p := bpairs[w]
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		hide, _ := json.Marshal(p.B.Sign(41012, nostr.Tags{{"h", p.Ch}}, ""))
		if _, err := c.pool.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, string(hide)); err != nil {
			return 0, "error: " + err.Error(), true
		}
		msg, _ := json.Marshal(p.A.Sign(9, nostr.Tags{{"h", p.Ch}}, "resurface "+strconv.Itoa(it)))
		t0 := time.Now()
		acc, pub, out, n, err := c.chainInSQL(ctx, string(msg), p.B.PK)
		retries.Add(int64(n))
		if acc > 0 {
			accLat.Add(acc)
		}
		if err != nil {
			return 0, "error: " + err.Error(), true
		}
		pubLat.Add(pub)
		if out != "published" {
			stale.Add(1)
		}
		return time.Since(t0), "", true
	})
	base.Name, base.Conns, base.Baseline = "accept+source+sign+publish", c.k, true
	base.Note = fmt.Sprintf("one transaction per chain; accept p50 %.1f ms, source+sign+publish+commit p50 %.1f ms; %d of %d not 'published', %d 'retry' (waited for the clock)",
		accLat.Summary().P50ms, pubLat.Summary().P50ms, stale.Load(), base.Count, retries.Load())
	return base, nil
}

// chainInSQL accepts msg and publishes viewer's snapshot in one transaction: the message's
// generation bump keeps the viewer's state row locked until our publication commits, so no
// relay listener races this chain. It returns how long the accept (once done) and the
// publication took.
func (c *converge) chainInSQL(ctx context.Context, msg, viewer string) (acc, pub time.Duration, out string, retries int, err error) {
	t0 := time.Now()
	tx, err := c.pool.Begin(ctx)
	if err != nil {
		return 0, 0, "", 0, err
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT buzz.accept_event($1::jsonb)`, msg); err != nil {
		return 0, 0, "", 0, err
	}
	t1 := time.Now()
	acc = t1.Sub(t0)
	out, retries, err = publishDirect(ctx, tx, c.cfg.RelayKey, c.relayPK, viewer)
	if err != nil {
		return acc, 0, "", retries, err
	}
	if err := tx.Commit(ctx); err != nil {
		return acc, 0, "", retries, err
	}
	return acc, time.Since(t1), out, retries, nil
}

// publishDirect does what the listener does for one viewer: one consistent read, build and sign
// the 30622 with the relay key, fenced publish; 'retry' re-reads (created_at floor moved).
func publishDirect(ctx context.Context, pool interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, relaySK, relayPK, viewer string) (string, int, error) {
	for try := 0; try < 50; try++ {
		var gen, floor, now int64
		var hidden []string
		err := pool.QueryRow(ctx, `SELECT s.generation, s.hidden::text[], s.created_at_floor, buzz.now_unix()
		                             FROM buzz.visibility_source($1) s`, viewer).Scan(&gen, &hidden, &floor, &now)
		if err != nil {
			return "", try, err
		}
		created := now
		if floor+1 > created {
			created = floor + 1
		}
		tags := nostr.Tags{{"d", viewer}, {"p", viewer}}
		sort.Strings(hidden)
		for _, h := range hidden {
			tags = append(tags, nostr.Tag{"h", h})
		}
		ev := &nostr.Event{Kind: 30622, CreatedAt: nostr.Timestamp(created), Tags: tags, Content: ""}
		if err := ev.Sign(relaySK); err != nil {
			return "", try, err
		}
		if ev.PubKey != relayPK {
			return "", try, fmt.Errorf("--relay-key is not the key of the relays (NIP-11 pubkey %s)", relayPK)
		}
		raw, _ := json.Marshal(ev)
		var out string
		if err := pool.QueryRow(ctx, `SELECT buzz.publish_visibility_snapshot($1, $2, $3::jsonb)`, viewer, gen, string(raw)).Scan(&out); err != nil {
			return "", try, err
		}
		if out != "retry" {
			return out, try, nil
		}
		time.Sleep(50 * time.Millisecond) // the floor is ahead of the clock: wait for it
	}
	return "", 50, fmt.Errorf("publish kept answering retry")
}

// Reminders: cfg.N reminders (kind 30300) from cfg.Conns authors, all with the same not_before a
// few seconds ahead; each author has a subscription that only due signals can match (since far in
// the future: due delivery ignores since/until). Lateness = receive time - not_before.
// Baseline: the scheduler's SQL for the same burst size -- buzz.claim_due_reminders(100, ...) +
// buzz.confirm_reminder_claims per batch on one connection -- inside a transaction that is rolled
// back (so the running schedulers never see those rows).
func Reminders(cfg *Config) (*Result, error) {
	r := &reminders{cfg: cfg, res: newResult("reminders", cfg), authors: min(cfg.Conns, 16), n: cfg.N, tag: runTag(),
		recv: map[string][]time.Time{}, sendAt: make(map[string]time.Time, cfg.N), okTimes: map[string]time.Time{}}
	r.users = make([]User, r.authors)
	for i := range r.users {
		r.users[i] = NewUser()
	}
	r.perConn = make([]map[string]int, r.authors)
	for i := range r.perConn {
		r.perConn[i] = map[string]int{}
	}
	cs, err := r.connect()
	defer closeAll(cs)
	if err != nil {
		return nil, err
	}
	if err := r.publish(cs); err != nil {
		return nil, err
	}
	span := r.measureLateness()
	pool, err := openPool(cfg, r.authors+1)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	return r.baselines(pool, span)
}

// reminders is one run of the reminders scenario: a burst of n reminders, all due in the same
// second, published by authors connections that each receive their own due signals.
type reminders struct {
	cfg        *Config
	res        *Result
	authors, n int
	tag        string
	users      []User
	nb         int64 // the burst's not_before

	mu      sync.Mutex
	recv    map[string][]time.Time // id -> receipt times (all connections)
	perConn []map[string]int       // connection -> id -> receipts
	sendAt  map[string]time.Time

	okLat   Latencies
	okErrs  Errors
	okMu    sync.Mutex
	okTimes map[string]time.Time
	oks     atomic.Int64
}

// connect dials the authors, each subscribed to its due signals.
func (r *reminders) connect() ([]*wsclient.Client, error) {
	cs, err := dialAll(r.cfg.Relays, r.authors, func(i int) string { return r.users[i].SK }, r.handlers)
	if err != nil {
		return cs, err
	}
	far := nostr.Timestamp(4102444800) // 2100-01-01: only due signals (which ignore since) match
	for i, c := range cs {
		if err := c.Req("due", 10*time.Second, nostr.Filter{Kinds: []int{30300}, Authors: []string{r.users[i].PK}, Since: &far}); err != nil {
			return cs, err
		}
	}
	return cs, nil
}

// handlers record connection i's due signals and the OKs of the burst.
func (r *reminders) handlers(i int) wsclient.Handlers {
	return wsclient.Handlers{
		OnEvent: func(sub string, ev *nostr.Event, at time.Time) {
			if sub != "due" {
				return
			}
			r.mu.Lock()
			r.recv[ev.ID] = append(r.recv[ev.ID], at)
			r.perConn[i][ev.ID]++
			r.mu.Unlock()
		},
		OnOK: func(o wsclient.OK) {
			r.mu.Lock()
			t0, ok := r.sendAt[o.ID]
			r.mu.Unlock()
			if !ok {
				return
			}
			r.oks.Add(1)
			r.okLat.Add(o.At.Sub(t0))
			r.okMu.Lock()
			r.okTimes[o.ID] = o.At
			r.okMu.Unlock()
			if !o.OK {
				r.okErrs.Add(o.Msg)
			}
		},
	}
}

// publish pre-signs the burst, due a few seconds from now, pipelines it and waits for the OKs.
func (r *reminders) publish(cs []*wsclient.Client) error {
	lead := 3*time.Second + 2*time.Duration(r.n)*time.Millisecond
	r.nb = time.Now().Add(lead).Truncate(time.Second).Add(time.Second).Unix()
	r.cfg.logf("reminders: pre-signing %d reminders due at %d", r.n, r.nb)
	evs := signParallel(r.n, func(i int) *nostr.Event {
		return r.users[i%r.authors].Sign(30300, nostr.Tags{{"d", fmt.Sprintf("r-%s-%d", r.tag, i)}, {"not_before", strconv.FormatInt(r.nb, 10)}}, "encrypted?")
	})
	pubStart := time.Now()
	for i, ev := range evs {
		r.mu.Lock()
		r.sendAt[ev.ID] = time.Now()
		r.mu.Unlock()
		if err := cs[i%r.authors].Send(ev); err != nil {
			return err
		}
	}
	for r.oks.Load() < int64(r.n) && time.Now().Before(pubStart.Add(60*time.Second)) {
		time.Sleep(10 * time.Millisecond)
	}
	pubEl := time.Since(pubStart)
	if time.Now().Unix() >= r.nb {
		r.res.Notes = append(r.res.Notes, "publishing took longer than the lead: not_before had passed before all OKs came")
	}
	r.res.Rows = append(r.res.Rows, Row{Name: "publish 30300 (pipelined)", Conns: r.authors, Count: int(r.oks.Load()),
		Seconds: pubEl.Seconds(), Rate: float64(r.oks.Load()) / pubEl.Seconds(), Latency: r.okLat.Summary(), Errors: r.okErrs.Map()})
	return nil
}

// measureLateness waits for the due signals and adds the lateness row; it returns the span from
// not_before to the last receipt.
func (r *reminders) measureLateness() time.Duration {
	due := time.Unix(r.nb, 0)
	deadline := due.Add(60 * time.Second)
	for time.Now().Before(deadline) {
		r.mu.Lock()
		got := len(r.recv)
		r.mu.Unlock()
		if got >= r.n {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	okAt := r.okAt()
	var late Latencies
	var last time.Time
	afterNB := 0
	r.mu.Lock()
	for id, ts := range r.recv {
		// A reminder stored only after its not_before (publishing fell behind) is due from its OK.
		from := due
		if t := okAt[id]; t.After(due) {
			from = t
			afterNB++
		}
		late.Add(ts[0].Sub(from))
		if ts[0].After(last) {
			last = ts[0]
		}
	}
	dups := r.duplicates()
	got := len(r.recv)
	r.mu.Unlock()
	errs := map[string]int{}
	if got < r.n {
		errs["missing"] = r.n - got
	}
	if dups > 0 {
		errs["duplicate"] = dups
	}
	span := last.Sub(due)
	r.res.Rows = append(r.res.Rows, Row{Name: "due signal lateness", Conns: r.authors, Count: got, Seconds: span.Seconds(),
		Rate: float64(got) / span.Seconds(), Latency: late.Summary(), Errors: errs,
		Note: fmt.Sprintf("lateness = receive - max(not_before, OK); %d of %d were stored after not_before; rate = burst / (last receipt - not_before)", afterNB, got)})
	r.res.Extra["duplicates_per_connection"] = dups
	return span
}

// okAt is when each reminder was stored: its OK, or its sending when no OK came.
func (r *reminders) okAt() map[string]time.Time {
	okAt := map[string]time.Time{}
	r.mu.Lock()
	for id, t0 := range r.sendAt {
		okAt[id] = t0
	}
	r.mu.Unlock()
	r.okMu.Lock()
	for id, t := range r.okTimes {
		okAt[id] = t
	}
	r.okMu.Unlock()
	return okAt
}

// duplicates counts the receipts past the first of each id on each connection (r.mu held).
func (r *reminders) duplicates() int {
	dups := 0
	for _, m := range r.perConn {
		for _, c := range m {
			if c > 1 {
				dups += c - 1
			}
		}
	}
	return dups
}

// baselines measure the same burst in SQL: publishing (accept_event, closed loop) and claiming
// with confirmation; the ratio compares the claim with the relay's span.
func (r *reminders) baselines(pool *pgxpool.Pool, span time.Duration) (*Result, error) {
	res, authors, n := r.res, r.authors, r.n
	tomorrow := strconv.FormatInt(time.Now().Unix()+86400, 10)
	pevs := split(signParallel(n, func(i int) *nostr.Event {
		return r.users[i%authors].Sign(30300, nostr.Tags{{"d", fmt.Sprintf("p-%s-%d", r.tag, i)}, {"not_before", tomorrow}}, "baseline")
	}), authors)
	r.cfg.logf("reminders: SQL baseline of publishing (accept_event on %d connections)", authors)
	prow := runWorkers(counts(pevs), 0, 5*time.Minute, sqlJob(pool, marshalAll(pevs)))
	prow.Name, prow.Conns, prow.Baseline = "buzz.accept_event 30300", authors, true
	prow.Note = "closed loop (the relay row above is pipelined); not_before tomorrow"
	res.Rows = append(res.Rows, prow)
	past := strconv.FormatInt(time.Now().Unix()-5, 10)
	bevs := signParallel(n, func(i int) *nostr.Event {
		return r.users[i%authors].Sign(30300, nostr.Tags{{"d", fmt.Sprintf("b-%s-%d", r.tag, i)}, {"not_before", past}}, "baseline")
	})
	r.cfg.logf("reminders: SQL baseline (claim+confirm %d in batches of 100, rolled back)", n)
	el, claimed, err := reminderBaseline(pool, bevs)
	if err != nil {
		return nil, err
	}
	res.Rows = append(res.Rows, Row{Name: "claim_due_reminders+confirm x100", Conns: 1, Count: claimed, Seconds: el.Seconds(),
		Rate: float64(claimed) / el.Seconds(), Baseline: true, Note: "one connection, one transaction, rolled back"})
	res.Ratio = ratio(span.Seconds(), el.Seconds())
	res.RatioWhat = "relay (last due receipt - not_before) / SQL time to claim and confirm the same burst"
	res.Extra["publish_ratio"] = ratio(res.Rows[0].Rate, prow.Rate)
	res.Notes = append(res.Notes, fmt.Sprintf("publish: relay %.1f/s pipelined vs accept_event %.1f/s closed loop on %d connections (ratio %.3f)",
		res.Rows[0].Rate, prow.Rate, authors, ratio(res.Rows[0].Rate, prow.Rate)))
	return res, nil
}

func reminderBaseline(pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, evs []*nostr.Event) (time.Duration, int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, 0, err
	}
	defer tx.Rollback(ctx)
	for _, ev := range evs {
		raw, _ := json.Marshal(ev)
		var ok bool
		var msg string
		if err := tx.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(raw)).Scan(&ok, &msg); err != nil {
			return 0, 0, err
		}
		if !ok {
			return 0, 0, fmt.Errorf("baseline reminder refused: %s", msg)
		}
	}
	start := time.Now()
	claimed := 0
	for {
		rows, err := tx.Query(ctx, `SELECT id, stamp FROM buzz.claim_due_reminders(100, '30 seconds')`)
		if err != nil {
			return 0, 0, err
		}
		var ids []string
		var stamps []int64
		for rows.Next() {
			var id string
			var st int64
			if err := rows.Scan(&id, &st); err != nil {
				rows.Close()
				return 0, 0, err
			}
			ids, stamps = append(ids, id), append(stamps, st)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return 0, 0, err
		}
		if len(ids) == 0 {
			break
		}
		claimed += len(ids)
		if _, err := tx.Exec(ctx, `SELECT count(*) FROM buzz.confirm_reminder_claims($1, $2)`, ids, stamps); err != nil {
			return 0, 0, err
		}
	}
	return time.Since(start), claimed, nil
}
