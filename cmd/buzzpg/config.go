package main

import (
	"flag"
	"fmt"
	"math"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/buzzpg/buzzpg/internal/store"
	"github.com/buzzpg/buzzpg/listener/upkeep"
)

// serveConfig is everything `buzzpg serve` reads. Each field has an environment variable and a
// flag of the same meaning; the flag wins.
type serveConfig struct {
	DatabaseURL      string
	Listen           string
	RelayURL         string
	RelayKey         string
	RelayKeyFile     string
	InstanceID       string
	AutoMigrate      bool
	NoRelay          bool
	LogFormat        string
	LogLevel         string
	SweepInterval    time.Duration
	Lease            time.Duration
	BackoffMax       time.Duration
	SlotStaleAfter   time.Duration
	ReminderLease    time.Duration
	ReminderHorizon  time.Duration
	QueryTimeout     time.Duration
	MaxFutureSeconds int64
	AcceptConns      int
	AcceptConnsMin   int
	AcceptBatch      int
	AcceptBatchCalls int
	EventWindow      int
	QueryConns       int
	EventRate        float64 // EVENTs per second per connection (token bucket), 0 = unlimited
	EventBurst       int
	ReqRate          float64 // REQ/COUNT per second per connection
	ReqBurst         int
	IPEventRate      float64 // EVENTs per second per client IP across its connections
	IPReqRate        float64
	MaxConns         int     // open WebSocket connections per process
	IPMaxConns       int     // of them from one client IP
	IPMaxSubs        int     // live subscriptions of one client IP across its connections
	MaxSubs          int     // live subscriptions of the process
	DedupMB          int     // memory of the subscriptions' de-duplication windows together
	InboxEvents      int     // live deliveries waiting to be matched, per connection
	IPInboxEvents    int     // and per client IP across its connections
	IPDeliveryRate   float64 // live delivery units per second per client IP, 0 = unlimited
	IPDeliveryBurst  int
	ShutdownGrace    time.Duration
	DBWait           time.Duration
	ReminderBatch    int
	DebugListen      string
	MetricsListen    string
	TrustedProxies   []netip.Prefix
	ResultBudgetMB   int // initial REQ results held in memory until sent, across connections
	ResultIPShareMB  int // of which one client IP's connections may hold together; 0: half the budget
	SendBudgetMB     int // bytes waiting in send queues across connections
	SendIPShareMB    int // of which one client IP's connections may hold together; 0: a quarter

	// Upkeep (listener/upkeep): one process of the deployment purges at a time.
	UpkeepInterval     time.Duration // between passes
	UpkeepBatch        int           // rows per purge transaction
	UpkeepPause        time.Duration // between two batches of one pass
	UpkeepGrace        time.Duration // expired events are kept this long past their expiration
	UpkeepReminderKeep time.Duration // confirmed/cancelled reminder rows are kept this long
}

func envStr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

func envDur(name string, def time.Duration) time.Duration {
	if v := os.Getenv(name); v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
		badEnv = append(badEnv, fmt.Sprintf("%s=%q is not a duration (e.g. 5s, 1m)", name, v))
	}
	return def
}

// badEnv collects environment values that do not parse: serve refuses to start on them rather
// than run with a default the operator did not ask for (BUZZ_AUTO_MIGRATE=off must not migrate).
var badEnv []string

func envBool(name string, def bool) bool {
	if v := os.Getenv(name); v != "" {
		switch strings.ToLower(v) {
		case "1", "t", "true", "yes", "y", "on":
			return true
		case "0", "f", "false", "no", "n", "off":
			return false
		}
		badEnv = append(badEnv, fmt.Sprintf("%s=%q is not a boolean (true/false, yes/no, on/off, 1/0)", name, v))
	}
	return def
}

func envInt(name string, def int) int {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
		badEnv = append(badEnv, fmt.Sprintf("%s=%q is not an integer", name, v))
	}
	return def
}

func envFloat(name string, def float64) float64 {
	if v := os.Getenv(name); v != "" {
		if n, err := strconv.ParseFloat(v, 64); err == nil {
			return n
		}
		badEnv = append(badEnv, fmt.Sprintf("%s=%q is not a number", name, v))
	}
	return def
}

func parseServeConfig(args []string) (serveConfig, error) {
	var c serveConfig
	badEnv = nil
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.StringVar(&c.DatabaseURL, "database-url", envStr("DATABASE_URL", ""), "PostgreSQL URL (DATABASE_URL)")
	fs.StringVar(&c.Listen, "listen", envStr("BUZZ_LISTEN", "127.0.0.1:7777"), "address for WebSocket and HTTP (BUZZ_LISTEN)")
	fs.StringVar(&c.RelayURL, "relay-url", envStr("BUZZ_RELAY_URL", ""), "public relay URL checked in NIP-42 AUTH (BUZZ_RELAY_URL; default ws:// + listen)")
	fs.StringVar(&c.RelayKey, "relay-key", envStr("BUZZ_RELAY_KEY", ""), "relay secret key, hex (BUZZ_RELAY_KEY)")
	fs.StringVar(&c.RelayKeyFile, "relay-key-file", envStr("BUZZ_RELAY_KEY_FILE", ""), "file holding the relay secret key (BUZZ_RELAY_KEY_FILE)")
	fs.StringVar(&c.InstanceID, "instance-id", envStr("BUZZ_INSTANCE_ID", ""), "unique id of this process; names its replication slot (BUZZ_INSTANCE_ID; default <host>_<pid>_<n>)")
	fs.BoolVar(&c.AutoMigrate, "auto-migrate", envBool("BUZZ_AUTO_MIGRATE", true), "apply migrations at start (BUZZ_AUTO_MIGRATE); turn off for rolling deploys")
	fs.BoolVar(&c.NoRelay, "no-relay", envBool("BUZZ_NO_RELAY", false), "run the listener only, no WebSocket relay (BUZZ_NO_RELAY)")
	fs.StringVar(&c.LogFormat, "log-format", envStr("BUZZ_LOG_FORMAT", "text"), "text or json (BUZZ_LOG_FORMAT)")
	fs.StringVar(&c.LogLevel, "log-level", envStr("BUZZ_LOG_LEVEL", "info"), "debug, info, warn, error (BUZZ_LOG_LEVEL)")
	fs.DurationVar(&c.SweepInterval, "sweep-interval", envDur("BUZZ_SWEEP_INTERVAL", 3*time.Second), "periodic outbox sweep (BUZZ_SWEEP_INTERVAL)")
	fs.DurationVar(&c.Lease, "lease", envDur("BUZZ_LEASE", 30*time.Second), "outbox claim lease (BUZZ_LEASE)")
	fs.DurationVar(&c.BackoffMax, "backoff-max", envDur("BUZZ_BACKOFF_MAX", time.Minute), "cap of the publication retry backoff (BUZZ_BACKOFF_MAX)")
	fs.DurationVar(&c.SlotStaleAfter, "slot-stale-after", envDur("BUZZ_SLOT_STALE_AFTER", 60*time.Second), "drop replication slots of instances silent this long (BUZZ_SLOT_STALE_AFTER)")
	fs.DurationVar(&c.ReminderLease, "reminder-lease", envDur("BUZZ_REMINDER_LEASE", 30*time.Second), "reminder claim lease (BUZZ_REMINDER_LEASE)")
	fs.DurationVar(&c.ReminderHorizon, "reminder-horizon", envDur("BUZZ_REMINDER_HORIZON", 365*24*time.Hour), "how far ahead not_before may be (BUZZ_REMINDER_HORIZON)")
	fs.DurationVar(&c.QueryTimeout, "query-timeout", envDur("BUZZ_QUERY_TIMEOUT", 5*time.Second), "statement_timeout of REQ/COUNT queries (BUZZ_QUERY_TIMEOUT)")
	fs.Int64Var(&c.MaxFutureSeconds, "max-future-seconds", int64(envInt("BUZZ_MAX_FUTURE_SECONDS", 900)), "how far ahead of now created_at may be (BUZZ_MAX_FUTURE_SECONDS)")
	fs.IntVar(&c.AcceptConns, "accept-conns", envInt("BUZZ_ACCEPT_CONNS", 16), "PostgreSQL connections for accept_event (BUZZ_ACCEPT_CONNS)")
	fs.IntVar(&c.AcceptConnsMin, "accept-conns-min", envInt("BUZZ_ACCEPT_CONNS_MIN", 8), "accept_event connections opened and warmed before serving, and kept open (BUZZ_ACCEPT_CONNS_MIN)")
	fs.IntVar(&c.AcceptBatch, "accept-batch", envInt("BUZZ_ACCEPT_BATCH", 120), "most EVENTs stored in one transaction when events arrive faster than they are stored, 1 to 120 (past 60 only while most are stored set-based); 1 stores each alone (BUZZ_ACCEPT_BATCH)")
	fs.IntVar(&c.EventWindow, "event-window", envInt("BUZZ_EVENT_WINDOW", 64), "EVENTs one connection may have in flight (read, not yet answered); 1 answers each before reading the next (BUZZ_EVENT_WINDOW)")
	fs.IntVar(&c.AcceptBatchCalls, "accept-batch-calls", envInt("BUZZ_ACCEPT_BATCH_CALLS", 3), "most accept_events calls in flight at once, past the first only while a full batch waits, a quarter of it events stored one by one (DMs, channel messages); events arriving meanwhile wait and go together in the next (BUZZ_ACCEPT_BATCH_CALLS)")
	fs.IntVar(&c.QueryConns, "query-conns", envInt("BUZZ_QUERY_CONNS", 8), "PostgreSQL connections for REQ/COUNT (BUZZ_QUERY_CONNS)")
	fs.Float64Var(&c.EventRate, "event-rate", envFloat("BUZZ_EVENT_RATE", 0), "EVENTs per second per connection, 0 = unlimited (BUZZ_EVENT_RATE)")
	fs.IntVar(&c.EventBurst, "event-burst", envInt("BUZZ_EVENT_BURST", 100), "burst for --event-rate (BUZZ_EVENT_BURST)")
	fs.Float64Var(&c.ReqRate, "req-rate", envFloat("BUZZ_REQ_RATE", 0), "REQ/COUNT per second per connection, 0 = unlimited (BUZZ_REQ_RATE)")
	fs.IntVar(&c.ReqBurst, "req-burst", envInt("BUZZ_REQ_BURST", 50), "burst for --req-rate (BUZZ_REQ_BURST)")
	fs.Float64Var(&c.IPEventRate, "ip-event-rate", envFloat("BUZZ_IP_EVENT_RATE", 0), "EVENTs per second per client IP, 0 = unlimited (BUZZ_IP_EVENT_RATE)")
	fs.Float64Var(&c.IPReqRate, "ip-req-rate", envFloat("BUZZ_IP_REQ_RATE", 0), "REQ/COUNT per second per client IP, 0 = unlimited (BUZZ_IP_REQ_RATE)")
	fs.IntVar(&c.MaxConns, "max-conns", envInt("BUZZ_MAX_CONNS", 10000), "open WebSocket connections per process; over it upgrades get 503 (BUZZ_MAX_CONNS)")
	fs.IntVar(&c.IPMaxConns, "ip-max-conns", envInt("BUZZ_IP_MAX_CONNS", 1000), "open WebSocket connections per client IP; over it upgrades get 429 (BUZZ_IP_MAX_CONNS)")
	fs.IntVar(&c.IPMaxSubs, "ip-max-subscriptions", envInt("BUZZ_IP_MAX_SUBSCRIPTIONS", 4096), "live subscriptions per client IP across its connections; over it a REQ is CLOSED restricted: (BUZZ_IP_MAX_SUBSCRIPTIONS)")
	fs.IntVar(&c.MaxSubs, "max-subscriptions", envInt("BUZZ_MAX_SUBSCRIPTIONS", 100000), "live subscriptions of the process; over it a REQ is CLOSED restricted: (BUZZ_MAX_SUBSCRIPTIONS)")
	fs.IntVar(&c.DedupMB, "dedup-mb", envInt("BUZZ_DEDUP_MB", 256), "MiB the subscriptions' de-duplication windows hold together; past it windows stop growing (BUZZ_DEDUP_MB)")
	fs.IntVar(&c.InboxEvents, "inbox-events", envInt("BUZZ_INBOX_EVENTS", 8192), "live events waiting to be matched against one connection's subscriptions; past it the connection is closed as slow (BUZZ_INBOX_EVENTS)")
	fs.IntVar(&c.IPInboxEvents, "ip-inbox-events", envInt("BUZZ_IP_INBOX_EVENTS", 32768), "the same across one client IP's connections (BUZZ_IP_INBOX_EVENTS)")
	fs.Float64Var(&c.IPDeliveryRate, "ip-delivery-rate", envFloat("BUZZ_IP_DELIVERY_RATE", 20000), "live delivery per second to one client IP's connections together, in units: a copy of an event is one, plus one per KiB; over it its deliveries wait in its inboxes; 0 = unlimited (BUZZ_IP_DELIVERY_RATE)")
	fs.IntVar(&c.IPDeliveryBurst, "ip-delivery-burst", envInt("BUZZ_IP_DELIVERY_BURST", 2000), "burst for --ip-delivery-rate (BUZZ_IP_DELIVERY_BURST)")
	fs.DurationVar(&c.ShutdownGrace, "shutdown-grace", envDur("BUZZ_SHUTDOWN_GRACE", 10*time.Second), "how long graceful shutdown may take (BUZZ_SHUTDOWN_GRACE)")
	fs.IntVar(&c.ReminderBatch, "reminder-batch", envInt("BUZZ_REMINDER_BATCH", 1000), "reminders claimed and confirmed per transaction (BUZZ_REMINDER_BATCH)")
	fs.StringVar(&c.MetricsListen, "metrics-listen", envStr("BUZZ_METRICS_LISTEN", ""), "address for /metrics and a detailed /readyz, off when empty; keep it private (BUZZ_METRICS_LISTEN)")
	fs.StringVar(&c.DebugListen, "debug-listen", envStr("BUZZ_DEBUG_LISTEN", ""), "address for Go's /debug/pprof profiles, off when empty; keep it private (BUZZ_DEBUG_LISTEN)")
	fs.DurationVar(&c.DBWait, "db-wait", envDur("BUZZ_DB_WAIT", 30*time.Second), "how long to wait for PostgreSQL at start, e.g. while it restarts (BUZZ_DB_WAIT)")
	fs.IntVar(&c.ResultIPShareMB, "result-ip-share-mb", envInt("BUZZ_RESULT_IP_SHARE_MB", 0), "MiB of that budget one client IP's connections may hold together; 0 = half the budget (BUZZ_RESULT_IP_SHARE_MB)")
	fs.IntVar(&c.SendBudgetMB, "send-budget-mb", envInt("BUZZ_SEND_BUDGET_MB", 1024), "MiB waiting in send queues across connections; past it a connection with a backlog is closed as a slow client (BUZZ_SEND_BUDGET_MB)")
	fs.IntVar(&c.SendIPShareMB, "send-ip-share-mb", envInt("BUZZ_SEND_IP_SHARE_MB", 0), "MiB of that budget one client IP's connections may hold together; 0 = a quarter of the budget (BUZZ_SEND_IP_SHARE_MB)")
	fs.IntVar(&c.ResultBudgetMB, "result-budget-mb", envInt("BUZZ_RESULT_BUDGET_MB", 256), "MiB of REQ initial results held in memory until sent, across connections; answers beyond it are cut short (BUZZ_RESULT_BUDGET_MB)")
	fs.DurationVar(&c.UpkeepInterval, "upkeep-interval", envDur("BUZZ_UPKEEP_INTERVAL", upkeep.DefaultInterval), "between upkeep passes; one process of the deployment purges at a time (BUZZ_UPKEEP_INTERVAL)")
	fs.IntVar(&c.UpkeepBatch, "upkeep-batch", envInt("BUZZ_UPKEEP_BATCH", upkeep.DefaultBatch), "rows removed per upkeep transaction (BUZZ_UPKEEP_BATCH)")
	fs.DurationVar(&c.UpkeepPause, "upkeep-pause", envDur("BUZZ_UPKEEP_PAUSE", upkeep.DefaultPause), "pause between two upkeep batches, so a large purge leaves PostgreSQL to the relay's traffic (BUZZ_UPKEEP_PAUSE)")
	fs.DurationVar(&c.UpkeepGrace, "upkeep-grace", envDur("BUZZ_UPKEEP_GRACE", upkeep.DefaultGrace), "expired (NIP-40) events are purged this long after their expiration (BUZZ_UPKEEP_GRACE)")
	fs.DurationVar(&c.UpkeepReminderKeep, "upkeep-reminder-keep", envDur("BUZZ_UPKEEP_REMINDER_KEEP", upkeep.DefaultReminderKeep), "confirmed and cancelled reminder rows are purged this long after they settled (BUZZ_UPKEEP_REMINDER_KEEP)")
	proxies := fs.String("trusted-proxies", envStr("BUZZ_TRUSTED_PROXIES", ""), "load balancers (IPs or CIDRs, comma-separated) whose X-Forwarded-For names the client IP for per-IP caps and rates (BUZZ_TRUSTED_PROXIES)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	var err error
	if c.TrustedProxies, err = parseProxies(*proxies); err != nil {
		badEnv = append(badEnv, err.Error())
	}
	if len(badEnv) > 0 {
		return c, fmt.Errorf("invalid environment: %s", strings.Join(badEnv, "; "))
	}
	if c.AcceptConns < 1 || c.QueryConns < 1 || c.AcceptConnsMin < 0 {
		return c, fmt.Errorf("BUZZ_ACCEPT_CONNS and BUZZ_QUERY_CONNS must be at least 1, BUZZ_ACCEPT_CONNS_MIN at least 0 (got %d, %d, %d)", c.AcceptConns, c.QueryConns, c.AcceptConnsMin)
	}
	if c.EventWindow < 1 || c.EventWindow > 4096 {
		return c, fmt.Errorf("BUZZ_EVENT_WINDOW must be 1 to 4096 (got %d)", c.EventWindow)
	}
	if c.AcceptBatch < 1 || c.AcceptBatch > store.MaxBatch || c.AcceptBatchCalls < 1 || c.AcceptBatchCalls > c.AcceptConns {
		return c, fmt.Errorf("BUZZ_ACCEPT_BATCH must be 1 to %d and BUZZ_ACCEPT_BATCH_CALLS 1 to BUZZ_ACCEPT_CONNS (%d) (got %d, %d)", store.MaxBatch, c.AcceptConns, c.AcceptBatch, c.AcceptBatchCalls)
	}
	if c.MaxConns < 1 || c.IPMaxConns < 1 {
		return c, fmt.Errorf("BUZZ_MAX_CONNS and BUZZ_IP_MAX_CONNS must be at least 1 (got %d, %d)", c.MaxConns, c.IPMaxConns)
	}
	if err := c.checkRanges(); err != nil {
		return c, err
	}
	// NIP-42 binds an AUTH to the relay URL the client signed. Without BUZZ_RELAY_URL on a
	// wildcard address the only candidate is the request's Host header, which the client writes:
	// a malicious relay could then have its own users sign AUTHs that are good here.
	if c.RelayURL == "" && !c.NoRelay && wildcardHost(c.Listen) {
		return c, fmt.Errorf("BUZZ_RELAY_URL is not set and BUZZ_LISTEN=%s names no host: set BUZZ_RELAY_URL to the URL clients use (e.g. wss://relay.example.com), which NIP-42 AUTH checks", c.Listen)
	}
	if c.RelayURL != "" {
		if err := checkRelayURL(c.RelayURL); err != nil {
			return c, err
		}
	}
	if c.DatabaseURL == "" {
		return c, fmt.Errorf("DATABASE_URL is not set: point it at PostgreSQL (make run starts a private cluster and sets it)")
	}
	// The relay and accept_event must enforce the same bound, and the relay advertises it in
	// NIP-11; 0 would mean "900" to the first and "no future at all" to the second.
	if c.MaxFutureSeconds <= 0 {
		return c, fmt.Errorf("BUZZ_MAX_FUTURE_SECONDS must be at least 1 (got %d)", c.MaxFutureSeconds)
	}
	// now + the bound must not overflow, in Go or in accept_event, which reads it from the
	// shared buzz.config: one process with a huge value would break acceptance on all of them.
	if c.MaxFutureSeconds > maxFutureSeconds {
		return c, fmt.Errorf("BUZZ_MAX_FUTURE_SECONDS must be at most %d, ten years (got %d)", maxFutureSeconds, c.MaxFutureSeconds)
	}
	if c.MetricsListen != "" && c.MetricsListen == c.Listen {
		return c, fmt.Errorf("BUZZ_METRICS_LISTEN and BUZZ_LISTEN are both %s: give the metrics their own (private) address", c.Listen)
	}
	if c.DebugListen != "" && (c.DebugListen == c.Listen || c.DebugListen == c.MetricsListen) {
		return c, fmt.Errorf("BUZZ_DEBUG_LISTEN %s is also BUZZ_LISTEN or BUZZ_METRICS_LISTEN: give the profiles their own (private) address", c.DebugListen)
	}
	if c.InstanceID == "" {
		host, _ := os.Hostname()
		c.InstanceID = fmt.Sprintf("%s_%d_%d", host, os.Getpid(), time.Now().UnixNano()%1e6)
	}
	return c, nil
}

// checkRelayURL refuses a BUZZ_RELAY_URL no AUTH could match. NIP-42 clients sign the WebSocket
// URL they connected to, so a value without ws:// or wss:// ("relay.example.com", "https://...")
// or without a host would start a relay that refuses every AUTH, and every gated read with it.
func checkRelayURL(v string) error {
	const hint = "set it to the URL clients connect to, e.g. wss://relay.example.com (ws:// without TLS)"
	u, err := url.Parse(strings.TrimSpace(v))
	switch {
	case err != nil:
		return fmt.Errorf("BUZZ_RELAY_URL=%q is not a URL (%v): %s", v, err, hint)
	case u.Scheme != "ws" && u.Scheme != "wss":
		return fmt.Errorf("BUZZ_RELAY_URL=%q is not a ws:// or wss:// URL, and NIP-42 AUTH names the relay by its WebSocket URL: %s", v, hint)
	case u.Hostname() == "":
		return fmt.Errorf("BUZZ_RELAY_URL=%q names no host: %s", v, hint)
	}
	return nil
}

// minSlotStaleAfter: a process beats every StaleAfter/3 at most, so below a few seconds a busy
// database or a reconnect makes a live process look dead, and a peer drops its slot (its
// subscribers then miss events).
const minSlotStaleAfter = 3 * time.Second

// maxLease bounds BUZZ_LEASE and BUZZ_REMINDER_LEASE. The SQL takes any non-NULL lease, but the
// lease is how long the claims of a process that died (kill -9, a partition) hold their rows
// before anyone else takes them: past an hour that is an outage of those snapshots and reminders,
// not a lease. It also bounds the work done under one claim (a publication's timeout, the
// re-reads after a reminder confirm whose outcome is unknown).
const maxLease = time.Hour

// minSendBudgetMB is one connection's send queue (the relay's default SendQueueBytes): a budget
// below it would close readers whose own queue is within its bound.
const minSendBudgetMB = 4

// maxFutureSeconds bounds BUZZ_MAX_FUTURE_SECONDS (ten years).
const maxFutureSeconds = 10 * 365 * 24 * 3600

// maxQueryTimeout bounds BUZZ_QUERY_TIMEOUT: it becomes each REQ's statement_timeout, which
// PostgreSQL refuses above 2^31-1 ms (every REQ would then fail), and a query that needs an hour
// is not one a relay should run for a client.
const maxQueryTimeout = time.Hour

// maxReminderBatch bounds BUZZ_REMINDER_BATCH. claim_due_reminders takes p_max as an integer, so
// PostgreSQL would refuse anything above 2^31-1, at every claim instead of at start-up. Far below
// that a batch stops making sense: it is one claim statement whose rows the process holds in
// memory, then one confirm transaction that locks every row, must finish within the lease, and
// emits a logical message per 100 signals that the fan-out of every process decodes as one
// transaction. A hundred times the default (1,000) leaves room for tuning and refuses typos.
const maxReminderBatch = 100_000

// maxUpkeepBatch bounds BUZZ_UPKEEP_BATCH: a batch is one transaction holding its rows' locks,
// which acceptance of the same ids waits for; past a few thousand it stops being short.
const maxUpkeepBatch = 10_000

// maxUpkeepKeep bounds BUZZ_UPKEEP_GRACE and BUZZ_UPKEEP_REMINDER_KEEP (ten years): the SQL reads
// them as whole seconds subtracted from now.
const maxUpkeepKeep = 10 * 365 * 24 * time.Hour

// checkRanges refuses values that parse but cannot work. Each would otherwise be replaced by a
// default somewhere below (a zero lease), or misbehave (a zero reminder horizon refuses every
// reminder; a negative rate is advertised in NIP-11 as is).
func (c *serveConfig) checkRanges() error {
	var bad []string
	atLeast := func(name string, d, min time.Duration) {
		if d < min {
			bad = append(bad, fmt.Sprintf("%s=%s must be at least %s", name, d, min))
		}
	}
	atMost := func(name string, d, max time.Duration) {
		if d > max {
			bad = append(bad, fmt.Sprintf("%s=%s must be at most %s", name, d, max))
		}
	}
	atLeast("BUZZ_SWEEP_INTERVAL", c.SweepInterval, time.Millisecond)
	atLeast("BUZZ_LEASE", c.Lease, time.Millisecond)
	atLeast("BUZZ_BACKOFF_MAX", c.BackoffMax, time.Millisecond)
	atLeast("BUZZ_REMINDER_LEASE", c.ReminderLease, time.Millisecond)
	atLeast("BUZZ_REMINDER_HORIZON", c.ReminderHorizon, time.Second)
	atLeast("BUZZ_QUERY_TIMEOUT", c.QueryTimeout, time.Millisecond)
	atLeast("BUZZ_SLOT_STALE_AFTER", c.SlotStaleAfter, minSlotStaleAfter)
	atLeast("BUZZ_SHUTDOWN_GRACE", c.ShutdownGrace, 0)
	atLeast("BUZZ_DB_WAIT", c.DBWait, 0)
	atMost("BUZZ_QUERY_TIMEOUT", c.QueryTimeout, maxQueryTimeout)
	atMost("BUZZ_LEASE", c.Lease, maxLease)
	atMost("BUZZ_REMINDER_LEASE", c.ReminderLease, maxLease)
	atLeast("BUZZ_UPKEEP_INTERVAL", c.UpkeepInterval, 10*time.Millisecond)
	atLeast("BUZZ_UPKEEP_GRACE", c.UpkeepGrace, 0)
	atLeast("BUZZ_UPKEEP_PAUSE", c.UpkeepPause, 0)
	atMost("BUZZ_UPKEEP_PAUSE", c.UpkeepPause, time.Minute)
	atLeast("BUZZ_UPKEEP_REMINDER_KEEP", c.UpkeepReminderKeep, 0)
	atMost("BUZZ_UPKEEP_GRACE", c.UpkeepGrace, maxUpkeepKeep)
	atMost("BUZZ_UPKEEP_REMINDER_KEEP", c.UpkeepReminderKeep, maxUpkeepKeep)
	if c.UpkeepBatch < 1 || c.UpkeepBatch > maxUpkeepBatch {
		bad = append(bad, fmt.Sprintf("BUZZ_UPKEEP_BATCH=%d must be 1 to %d", c.UpkeepBatch, maxUpkeepBatch))
	}
	if c.ReminderBatch > maxReminderBatch {
		bad = append(bad, fmt.Sprintf("BUZZ_REMINDER_BATCH=%d must be at most %d", c.ReminderBatch, maxReminderBatch))
	}
	for name, v := range map[string]float64{"BUZZ_EVENT_RATE": c.EventRate, "BUZZ_REQ_RATE": c.ReqRate,
		"BUZZ_IP_EVENT_RATE": c.IPEventRate, "BUZZ_IP_REQ_RATE": c.IPReqRate, "BUZZ_IP_DELIVERY_RATE": c.IPDeliveryRate} {
		if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) { // NaN passes "< 0", then breaks NIP-11's JSON
			bad = append(bad, fmt.Sprintf("%s=%g must be 0 (unlimited) or a finite number above it", name, v))
		}
	}
	for name, v := range map[string]int{"BUZZ_EVENT_BURST": c.EventBurst, "BUZZ_REQ_BURST": c.ReqBurst,
		"BUZZ_REMINDER_BATCH": c.ReminderBatch, "BUZZ_RESULT_BUDGET_MB": c.ResultBudgetMB, "BUZZ_SEND_BUDGET_MB": c.SendBudgetMB,
		"BUZZ_IP_MAX_SUBSCRIPTIONS": c.IPMaxSubs, "BUZZ_MAX_SUBSCRIPTIONS": c.MaxSubs, "BUZZ_DEDUP_MB": c.DedupMB,
		"BUZZ_INBOX_EVENTS": c.InboxEvents, "BUZZ_IP_INBOX_EVENTS": c.IPInboxEvents, "BUZZ_IP_DELIVERY_BURST": c.IPDeliveryBurst} {
		if v < 1 {
			bad = append(bad, fmt.Sprintf("%s=%d must be at least 1", name, v))
		}
	}
	if c.ResultIPShareMB < 0 {
		bad = append(bad, fmt.Sprintf("BUZZ_RESULT_IP_SHARE_MB=%d must be 0 (half the budget) or more", c.ResultIPShareMB))
	}
	if c.SendIPShareMB < 0 || c.SendIPShareMB > c.SendBudgetMB {
		bad = append(bad, fmt.Sprintf("BUZZ_SEND_IP_SHARE_MB=%d must be 0 (a quarter of the budget) or up to BUZZ_SEND_BUDGET_MB (%d)", c.SendIPShareMB, c.SendBudgetMB))
	}
	if c.SendBudgetMB < minSendBudgetMB {
		bad = append(bad, fmt.Sprintf("BUZZ_SEND_BUDGET_MB=%d must be at least %d, one connection's send queue", c.SendBudgetMB, minSendBudgetMB))
	}
	switch strings.ToLower(c.LogLevel) {
	case "debug", "info", "warn", "error":
	default:
		bad = append(bad, fmt.Sprintf("BUZZ_LOG_LEVEL=%q must be debug, info, warn or error", c.LogLevel))
	}
	switch strings.ToLower(c.LogFormat) {
	case "text", "json":
	default:
		bad = append(bad, fmt.Sprintf("BUZZ_LOG_FORMAT=%q must be text or json", c.LogFormat))
	}
	if len(bad) == 0 {
		return nil
	}
	slices.Sort(bad) // map order must not decide what the operator reads first
	return fmt.Errorf("invalid settings (each also has a serve flag): %s", strings.Join(bad, "; "))
}

// parseProxies reads "10.0.0.0/8, 192.0.2.7": CIDRs, or single addresses.
func parseProxies(list string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if p, err := netip.ParsePrefix(f); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(f)
		if err != nil {
			return nil, fmt.Errorf("BUZZ_TRUSTED_PROXIES: %q is neither an IP address nor a CIDR", f)
		}
		a = a.Unmap()
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return out, nil
}
