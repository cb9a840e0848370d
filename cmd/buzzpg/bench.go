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

flags:
`

// scenarios are the load tool's scenarios in the order `all` runs them.
var scenarios = []string{"ingest", "dm", "converge", "reminders", "fanout", "flood"}

type relayList []string

func (r *relayList) String() string     { return strings.Join(*r, ",") }
func (r *relayList) Set(v string) error { *r = append(*r, v); return nil }

func runBench(args []string) error {
	scenario := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		scenario, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var relays relayList
	fs.Var(&relays, "relay", "relay WebSocket URL (repeatable; fanout publishes on the first, subscribes on the last)")
	dbURL := fs.String("database-url", envStr("DATABASE_URL", ""), "PostgreSQL URL for setup and baselines (DATABASE_URL)")
	relayKey := fs.String("relay-key", envStr("BUZZ_RELAY_KEY", ""), "the relays' secret key, hex (converge baseline; BUZZ_RELAY_KEY)")
	relayKeyFile := fs.String("relay-key-file", envStr("BUZZ_RELAY_KEY_FILE", ""), "file holding the relays' secret key")
	dur := fs.Duration("duration", 10*time.Second, "how long each timed run lasts at most")
	conns := fs.Int("conns", 8, "client connections (and pool connections of the baseline)")
	rate := fs.Float64("rate", 0, "target total rate per second (0: closed loop as fast as it goes; fanout: ramp)")
	n := fs.Int("n", 20000, "events (reminders) to pre-sign: an upper bound on one run")
	idle := fs.Int("idle", 0, "fanout: this many more connections, spread over the relays, each authenticated and subscribed to its snapshots and to a feed of 50 authors who post nothing (from 127.0.1.x, 500 per address)")
	jsonOut := fs.String("json", "", "also write the results as JSON to this file")
	spawn := fs.Int("spawn", 0, "start this many `buzzpg serve` processes (on loopback) and bench them instead of --relay")
	fresh := fs.Bool("fresh", false, "with --spawn: create a fresh database on the --database-url server, drop it afterwards")
	quiet := fs.Bool("quiet", false, "no progress lines")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), benchUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if scenario == "" && fs.NArg() > 0 {
		scenario = fs.Arg(0)
	}
	if scenario == "" {
		fs.Usage()
		return fmt.Errorf("no scenario given")
	}
	// One scenario, or several separated by commas (one set of spawned relays for all); checked
	// before any relay is started.
	names := scenarios
	if scenario != "all" && scenario != "standard" {
		names = strings.Split(scenario, ",")
		for _, name := range names {
			if !slices.Contains(scenarios, name) {
				fs.Usage()
				return fmt.Errorf("unknown scenario %q", name)
			}
		}
	}
	if *relayKey == "" && *relayKeyFile != "" {
		sk, _, err := loadRelayKey("", *relayKeyFile)
		if err != nil {
			return err
		}
		*relayKey = sk
	}
	logf := func(format string, a ...any) {
		if !*quiet {
			fmt.Fprintf(os.Stderr, "bench: "+format+"\n", a...)
		}
	}
	if *conns < 1 {
		return fmt.Errorf("--conns must be at least 1")
	}
	if *n < 1 || *spawn < 0 || *idle < 0 {
		return fmt.Errorf("--n must be at least 1, --spawn and --idle at least 0")
	}

	var spawnFn func(string, []string) (string, func(), error)
	if *spawn > 0 {
		cleanup, urls, dbu, key, sp, err := spawnRelays(*spawn, *dbURL, *fresh, *relayKey, logf)
		if cleanup != nil {
			defer cleanup()
		}
		if err != nil {
			return err
		}
		relays, *dbURL, *relayKey, spawnFn = urls, dbu, key, sp
	}
	if len(relays) == 0 {
		return fmt.Errorf("no relay: give --relay ws://HOST:PORT (repeatable) or --spawn N")
	}
	for _, r := range relays {
		if err := loopbackOnly(r); err != nil {
			return err
		}
	}
	base := bench.Config{Relays: relays, DatabaseURL: *dbURL, RelayKey: *relayKey, Duration: *dur,
		Conns: *conns, Rate: *rate, N: *n, Idle: *idle, Logf: logf}

	type step struct {
		name string
		cfg  bench.Config
	}
	base.Spawn = spawnFn
	var steps []step
	switch scenario {
	case "standard":
		with := func(d time.Duration, c, n int) bench.Config {
			x := base
			x.Duration, x.Conns, x.N, x.Rate = d, c, n, 0
			return x
		}
		steps = []step{
			{"ingest", with(15*time.Second, 16, 40000)},
			{"dm", with(8*time.Second, 16, 16000)},
			{"converge", with(15*time.Second, 8, 100000)},
			{"reminders", with(0, 8, 2000)},
			{"fanout", with(4*time.Second, 4, 40000)},
			{"flood", with(6*time.Second, 4, 20000)},
		}
	default:
		for _, name := range names {
			steps = append(steps, step{name, base})
		}
	}

	host, _ := os.Hostname()
	env := map[string]string{"host": host, "cpus": fmt.Sprint(runtime.NumCPU()), "go": runtime.Version(),
		"date": time.Now().UTC().Format("2006-01-02"), "relays": strings.Join(relays, " ")}
	if sv := serverVersion(*dbURL); sv != "" {
		env["postgres"] = sv
	}
	var results []*bench.Result
	var failed []string
	for _, s := range steps {
		cfg := s.cfg
		var rs []*bench.Result
		var err error
		switch s.name {
		case "ingest":
			var r *bench.Result
			r, err = bench.Ingest(&cfg)
			rs = []*bench.Result{r}
		case "dm":
			rs, err = bench.DM(&cfg)
		case "converge":
			var r *bench.Result
			r, err = bench.Converge(&cfg)
			rs = []*bench.Result{r}
		case "reminders":
			var r *bench.Result
			r, err = bench.Reminders(&cfg)
			rs = []*bench.Result{r}
		case "fanout":
			var r *bench.Result
			r, err = bench.Fanout(&cfg)
			rs = []*bench.Result{r}
		case "flood":
			var r *bench.Result
			r, err = bench.Flood(&cfg)
			rs = []*bench.Result{r}
		}
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
	if *jsonOut != "" {
		if err := bench.WriteJSON(*jsonOut, results); err != nil {
			return err
		}
		fmt.Printf("results written to %s\n", *jsonOut)
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d scenario(s) failed: %s", len(failed), strings.Join(failed, "; "))
	}
	return nil
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
