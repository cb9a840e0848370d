package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/db"
)

const benchUsage = `usage: buzzpg bench SCENARIO [flags]

scenarios:
  ingest     kind 1 from --conns connections (pre-signed), closed loop; baseline accept_event on as many connections
  dm         DM messages: hot path (no hides), a mix with hides and resurfacing, and every message resurfacing
             (hide, message, hide, ...); baseline accept_event of the same sequences on other DMs
  converge   resurfacing message OK -> the viewer's live 30622; baseline accept+source+sign+publish in SQL (--relay-key)
  reminders  a burst of --n reminders due in the same second; lateness; baseline claim+confirm in SQL
  fanout     publish on the first --relay, receive on the last; ramp (or --rate) to the highest rate that keeps up;
             --idle N holds N more quiet, subscribed connections open meanwhile
  flood      a victim's EVENT->OK and REQ->EOSE p50/p99 alone and under a flood from another loopback IP
             (127.0.0.2), on a relay with rate limits and (with --spawn) on one without; --duration per phase
  all        every scenario above with the given flags; or name several, separated by commas (ingest,fanout)
  standard   the set ` + "`make bench`" + ` runs, each scenario with its own sizes (about 5 minutes)
  soak       (make soak-upkeep; not in all) --duration of DM traffic with hides, reminders and expiring
             events at --rate (default 100/s) while upkeep purges; hot table sizes every minute; fails
             unless they stay flat after the warm-up, expired events are purged and slot WAL stays bounded

flags:
`

// scenarios are the load tool's scenarios in the order `all` runs them.
var scenarios = []string{"ingest", "dm", "converge", "reminders", "fanout", "flood"}

// soakScenario runs only when named: it lasts minutes and exits non-zero when its bar is not met.
const soakScenario = "soak"

type relayList []string

func (r *relayList) String() string     { return strings.Join(*r, ",") }
func (r *relayList) Set(v string) error { *r = append(*r, v); return nil }

// benchArgs is what `buzzpg bench` was asked to do.
type benchArgs struct {
	names        []string // the scenarios to run, in order
	standard     bool     // make bench's set, each with its own sizes
	relays       relayList
	dbURL        string
	relayKey     string
	dur          time.Duration
	conns, n     int
	rate         float64
	idle, spawn  int
	fresh, quiet bool
	noBaseline   bool
	jsonOut      string
}

func runBench(args []string) error {
	a, err := parseBenchArgs(args)
	if err != nil {
		return err
	}
	logf := func(format string, v ...any) {
		if !a.quiet {
			fmt.Fprintf(os.Stderr, "bench: "+format+"\n", v...)
		}
	}
	var spawnFn func(string, []string) (string, func(), error)
	if a.spawn > 0 {
		cleanup, urls, dbu, key, sp, err := spawnRelays(a.spawn, a.dbURL, a.fresh, a.relayKey, logf)
		if cleanup != nil {
			defer cleanup()
		}
		if err != nil {
			return err
		}
		a.relays, a.dbURL, a.relayKey, spawnFn = urls, dbu, key, sp
	}
	if len(a.relays) == 0 {
		return fmt.Errorf("no relay: give --relay ws://HOST:PORT (repeatable) or --spawn N")
	}
	for _, r := range a.relays {
		if err := loopbackOnly(r); err != nil {
			return err
		}
	}
	base := bench.Config{Relays: a.relays, DatabaseURL: a.dbURL, RelayKey: a.relayKey, Duration: a.dur,
		Conns: a.conns, Rate: a.rate, N: a.n, Idle: a.idle, NoBaseline: a.noBaseline, Logf: logf, Spawn: spawnFn}
	results, failed := runBenchSteps(benchSteps(a, base), benchEnv(a))
	if a.jsonOut != "" {
		if err := bench.WriteJSON(a.jsonOut, results); err != nil {
			return err
		}
		fmt.Printf("results written to %s\n", a.jsonOut)
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d scenario(s) failed: %s", len(failed), strings.Join(failed, "; "))
	}
	return nil
}

// parseBenchArgs reads the scenario and the flags, and checks them before any relay is started.
func parseBenchArgs(args []string) (a benchArgs, err error) {
	scenario := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		scenario, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.Var(&a.relays, "relay", "relay WebSocket URL (repeatable; fanout publishes on the first, subscribes on the last)")
	fs.StringVar(&a.dbURL, "database-url", envStr("DATABASE_URL", ""), "PostgreSQL URL for setup and baselines (DATABASE_URL)")
	fs.StringVar(&a.relayKey, "relay-key", envStr("BUZZ_RELAY_KEY", ""), "the relays' secret key, hex (converge baseline; BUZZ_RELAY_KEY)")
	relayKeyFile := fs.String("relay-key-file", envStr("BUZZ_RELAY_KEY_FILE", ""), "file holding the relays' secret key")
	fs.DurationVar(&a.dur, "duration", 10*time.Second, "how long each timed run lasts at most")
	fs.IntVar(&a.conns, "conns", 8, "client connections (and pool connections of the baseline)")
	fs.Float64Var(&a.rate, "rate", 0, "target total rate per second (0: closed loop as fast as it goes; fanout: ramp)")
	fs.IntVar(&a.n, "n", 20000, "events (reminders) to pre-sign: an upper bound on one run")
	fs.IntVar(&a.idle, "idle", 0, "fanout: this many more connections, spread over the relays, each authenticated and subscribed to its snapshots and to a feed of 50 authors who post nothing (from 127.0.1.x, 500 per address)")
	fs.StringVar(&a.jsonOut, "json", "", "also write the results as JSON to this file")
	fs.IntVar(&a.spawn, "spawn", 0, "start this many `buzzpg serve` processes (on loopback) and bench them instead of --relay")
	fs.BoolVar(&a.fresh, "fresh", false, "with --spawn: create a fresh database on the --database-url server, drop it afterwards")
	fs.BoolVar(&a.quiet, "quiet", false, "no progress lines")
	fs.BoolVar(&a.noBaseline, "no-baseline", false, "ingest: the relay run only, no SQL baseline after it (make bench-purge)")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return a, err
	}
	if scenario == "" && fs.NArg() > 0 {
		scenario = fs.Arg(0)
	}
	if a.names, err = scenarioNames(scenario); err != nil {
		fs.Usage()
		return a, err
	}
	a.standard = scenario == "standard"
	if a.relayKey == "" && *relayKeyFile != "" {
		if a.relayKey, _, err = loadRelayKey("", *relayKeyFile); err != nil {
			return a, err
		}
	}
	if a.conns < 1 {
		return a, fmt.Errorf("--conns must be at least 1")
	}
	if a.n < 1 || a.spawn < 0 || a.idle < 0 {
		return a, fmt.Errorf("--n must be at least 1, --spawn and --idle at least 0")
	}
	return a, nil
}

// scenarioNames is one scenario, or several separated by commas (one set of spawned relays for
// all), or all of them.
func scenarioNames(scenario string) ([]string, error) {
	switch scenario {
	case "":
		return nil, fmt.Errorf("no scenario given")
	case "all", "standard":
		return scenarios, nil
	}
	names := strings.Split(scenario, ",")
	for _, name := range names {
		if !slices.Contains(scenarios, name) && name != soakScenario {
			return nil, fmt.Errorf("unknown scenario %q", name)
		}
	}
	return names, nil
}

// benchStep is one scenario run with its configuration.
type benchStep struct {
	name string
	cfg  bench.Config
}

// benchSteps gives each scenario its configuration: the flags', or make bench's sizes.
func benchSteps(a benchArgs, base bench.Config) []benchStep {
	if !a.standard {
		var steps []benchStep
		for _, name := range a.names {
			steps = append(steps, benchStep{name, base})
		}
		return steps
	}
	with := func(d time.Duration, c, n int) bench.Config {
		x := base
		x.Duration, x.Conns, x.N, x.Rate = d, c, n, 0
		return x
	}
	return []benchStep{
		{"ingest", with(15*time.Second, 16, 40000)},
		{"dm", with(8*time.Second, 16, 16000)},
		{"converge", with(15*time.Second, 8, 100000)},
		{"reminders", with(0, 8, 2000)},
		{"fanout", with(4*time.Second, 4, 40000)},
		{"flood", with(6*time.Second, 4, 20000)},
	}
}

// benchEnv describes the machine the figures come from.
func benchEnv(a benchArgs) map[string]string {
	host, _ := os.Hostname()
	env := map[string]string{"host": host, "cpus": fmt.Sprint(runtime.NumCPU()), "go": runtime.Version(),
		"date": time.Now().UTC().Format("2006-01-02"), "relays": strings.Join(a.relays, " ")}
	if sv := serverVersion(a.dbURL); sv != "" {
		env["postgres"] = sv
	}
	return env
}

// one makes a scenario that has one result look like those that have several.
func one(run func(*bench.Config) (*bench.Result, error)) func(*bench.Config) ([]*bench.Result, error) {
	return func(cfg *bench.Config) ([]*bench.Result, error) {
		r, err := run(cfg)
		return []*bench.Result{r}, err
	}
}

// scenarioRuns are the scenarios by name.
var scenarioRuns = map[string]func(*bench.Config) ([]*bench.Result, error){
	"ingest":    one(bench.Ingest),
	"dm":        bench.DM,
	"converge":  one(bench.Converge),
	"reminders": one(bench.Reminders),
	"fanout":    one(bench.Fanout),
	"flood":     one(bench.Flood),
	"soak":      one(bench.Soak),
}

// runBenchSteps runs each step, prints its tables, and goes on past a failed one.
func runBenchSteps(steps []benchStep, env map[string]string) (results []*bench.Result, failed []string) {
	for _, s := range steps {
		cfg := s.cfg
		rs, err := scenarioRuns[s.name](&cfg)
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", s.name, err))
			fmt.Fprintf(os.Stderr, "bench %s failed: %v\n", s.name, err)
			continue
		}
		for _, r := range rs {
			r.Env = env
			r.Print(os.Stdout)
			results = append(results, r)
		}
	}
	fmt.Printf("\nmachine: %s, %s CPUs, %s, PostgreSQL %s, %s\n", env["host"], env["cpus"], env["go"], env["postgres"], env["date"])
	return results, failed
}

// loopbackOnly keeps the load tool pointed at this machine.
func loopbackOnly(u string) error {
	p, err := url.Parse(u)
	if err != nil {
		return fmt.Errorf("bad relay URL %q: %v", u, err)
	}
	h := p.Hostname()
	if h != "localhost" && !strings.HasPrefix(h, "127.") && h != "::1" {
		return fmt.Errorf("relay %s is not on loopback: buzzpg bench only drives relays on this machine", u)
	}
	return nil
}

func serverVersion(u string) string {
	if u == "" {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, u)
	if err != nil {
		return ""
	}
	defer c.Close(ctx)
	var v string
	_ = c.QueryRow(ctx, `SHOW server_version`).Scan(&v)
	return v
}

// spawnRelays starts n `buzzpg serve` processes of this binary on loopback. With fresh it first
// creates a new database on the server of dbURL (dropped again by cleanup). spawn starts one more
// process later (with extra environment, e.g. rate limits); cleanup stops those too.
func spawnRelays(n int, dbURL string, fresh bool, key string, logf func(string, ...any)) (cleanup func(), urls []string, dbu, relayKey string,
	spawn func(name string, env []string) (string, func(), error), err error) {
	if dbURL == "" {
		return nil, nil, "", "", nil, fmt.Errorf("--spawn needs --database-url (or DATABASE_URL)")
	}
	bin, err := os.Executable()
	if err != nil {
		return nil, nil, "", "", nil, err
	}
	var cleanups []func()
	cleanup = func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}
	dbu = dbURL
	if fresh {
		name := fmt.Sprintf("buzz_bench_%d", time.Now().Unix())
		if dbu, err = createDatabase(dbURL, name); err != nil {
			return cleanup, nil, "", "", nil, err
		}
		logf("fresh database %s", name)
		cleanups = append(cleanups, func() { dropDatabase(dbURL, name) })
		if err = db.MigrateUp(dbu, nil); err != nil {
			return cleanup, nil, "", "", nil, err
		}
	}
	relayKey = key
	if relayKey == "" {
		relayKey = nostr.GeneratePrivateKey()
	}
	logDir, err := os.MkdirTemp("", "buzzpg-bench-")
	if err != nil {
		return cleanup, nil, "", "", nil, err
	}
	var mu sync.Mutex
	var procs []*bench.Proc
	cleanups = append(cleanups, func() {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range procs {
			p.Stop(15 * time.Second)
		}
	})
	start := func(inst string, env []string) (*bench.Proc, error) {
		p, err := bench.StartServe(bench.ProcOpts{Bin: bin, DatabaseURL: dbu, RelayKey: relayKey, InstanceID: inst, Env: env,
			LogPath: filepath.Join(logDir, inst+".log"), LogLevel: "info"}, 60*time.Second)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		procs = append(procs, p)
		mu.Unlock()
		logf("started buzzpg serve %s on %s (log %s)", inst, p.URL, p.Opts.LogPath)
		return p, nil
	}
	for i := 0; i < n; i++ {
		p, err := start(fmt.Sprintf("bench%d_%d", i, os.Getpid()), nil)
		if err != nil {
			return cleanup, nil, "", "", nil, err
		}
		urls = append(urls, p.URL)
	}
	spawn = func(name string, env []string) (string, func(), error) {
		p, err := start(fmt.Sprintf("%s_%d", name, os.Getpid()), env)
		if err != nil {
			return "", nil, err
		}
		return p.URL, func() { p.Stop(15 * time.Second) }, nil
	}
	return cleanup, urls, dbu, relayKey, spawn, nil
}

func createDatabase(serverURL, name string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return "", err
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", err
	}
	return db.WithDatabase(serverURL, name)
}

func dropDatabase(serverURL, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return
	}
	defer c.Close(ctx)
	_ = db.DropDatabase(ctx, c, name)
}
