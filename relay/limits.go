package relay

import (
	"errors"
	"log/slog"
	"net/netip"
	"time"
)

// Config configures a Server. Zero values take the defaults below; every limit enforced here is
// advertised in the NIP-11 document so clients can stay inside it.
type Config struct {
	RelayURL         string // for the NIP-42 relay tag check; empty: every AUTH is refused
	RelaySecretKey   string // hex; its pubkey goes into NIP-11
	Name             string
	Description      string
	MaxMessageLength int // websocket read limit in bytes; default 131072
	MaxSubscriptions int // per connection, default 32
	// MaxSubscriptionsPerIP bounds live subscriptions per client IP across its connections,
	// default 4096 (ipSlots): an office behind one address, not 1,000 connections' 32 each.
	MaxSubscriptionsPerIP int
	// MaxSubscriptionsTotal bounds live subscriptions across the process, default 100,000: with
	// DedupBytes that bounds what they hold (finding 5 of issue 29: 8,192 busy ones took 800 MB).
	MaxSubscriptionsTotal int
	// DedupBytes bounds the memory of the subscriptions' de-duplication windows together,
	// default 256 MiB (dedupBudget): past it, windows stop growing beyond dedupMinWindow ids.
	DedupBytes int64
	// InboxEvents bounds the live deliveries waiting in one connection's inbox to be matched
	// (inbox.go), default 8192; InboxEventsPerIP those of one client IP's connections together,
	// default 32768 (an entry is about 120 bytes; the event it points to is shared). A connection over either while it has a backlog of its own is closed as a
	// slow client.
	InboxEvents      int
	InboxEventsPerIP int
	// DeliveryRatePerIP bounds the live delivery one client IP's connections get together, in
	// units per second (deliveryShares: a copy sent is one unit and one more per KiB), default
	// 20,000 with a burst of DeliveryBurstPerIP, default 2,000 (a tenth of a second: a burst
	// is delivered at full speed, and one address's must not hold the machine for long). Over
	// it, its deliveries wait in its inboxes. Negative: unlimited.
	DeliveryRatePerIP  float64
	DeliveryBurstPerIP int

	MaxFilters       int   // per REQ/COUNT, default 16
	MaxLimit         int   // default 5000
	DefaultLimit     int   // default 500
	MaxEventTags     int   // default 2000
	MaxContentLength int   // unicode characters (NIP-11), default 65536
	MaxFutureSeconds int64 // created_at upper bound relative to now, default 900
	// SendQueueBytes bounds a connection's send queue, default 4 MiB. The copies of one event for
	// several subscriptions go in as one unit (sendQueue.offer), so the queue may pass it by up to
	// MaxSubscriptions copies of one event (about twice MaxMessageLength each, as written).
	SendQueueBytes int
	// SendBudget bounds the bytes waiting in all send queues together, default 1 GiB, and
	// SendClientShare those of one client IP's connections together, default a quarter of it
	// (and at least SendQueueBytes): a connection whose queue holds something when its push would
	// pass either is closed as a slow client (sendBudget).
	SendBudget      int64
	SendClientShare int64
	MaxConns        int // open WebSocket connections per process, default 10000 (over: HTTP 503)
	MaxConnsPerIP   int // of them from one client IP, default 1000 (over: HTTP 429)
	// TrustedProxies are load balancers whose X-Forwarded-For is believed for the client IP that
	// per-IP caps and rates count (see clientIP); empty: the TCP peer is the client.
	TrustedProxies []netip.Prefix
	QueryTimeout   time.Duration // per REQ/COUNT query, default 5s
	// InitialResultBudget bounds the bytes of REQ initial results held in memory until sent,
	// across all connections of the process (each query also stops at 16 MiB); an answer that
	// does not fit is cut short. Default 256 MiB.
	InitialResultBudget int64
	// InitialResultPerConn bounds the part of that budget one connection's answers hold at once
	// (default 32 MiB): a few slow readers cannot take all of it.
	InitialResultPerConn int64
	// InitialResultPerIP bounds the part one client IP's connections hold together (default: half
	// the budget, and at least InitialResultPerConn): one client cannot take all of it with a few
	// connections either.
	InitialResultPerIP int64
	// MaxQueriesInFlight bounds concurrent REQ/COUNT queries per connection (default 4); a client
	// that sends more waits (its reads stop) instead of taking more of the query pool.
	MaxQueriesInFlight int
	// MaxQueriesPerIP bounds them per client IP across its connections (default: half the query
	// pool), so that one client cannot hold every query connection.
	MaxQueriesPerIP int
	// AcceptBatch is the most EVENTs stored in one transaction (buzz.accept_events, group
	// commit; default 32, at most store.MaxBatch; 1 stores each on its own). AcceptBatchCalls
	// bounds those calls in flight (default 1, classic group commit: while one call runs, the
	// events that arrive wait and go together in the next; more start only for full batches of
	// events stored alone, store.Batcher).
	AcceptBatch      int
	AcceptBatchCalls int
	// EventWindow bounds the EVENTs one connection has read and not yet had answered (default
	// 64; 1: each EVENT is answered before the next message is read), EventWindowBytes their
	// frames' bytes (default 1 MiB). A full window stops the connection's reads (pipeline.go).
	EventWindow      int
	EventWindowBytes int
	ReminderHorizon  time.Duration // how far ahead a 30300 not_before may be; default one year
	// Rate limits (token buckets); a rate of 0 means unlimited. Per connection, and per client IP
	// across all its connections. Over the limit: OK/CLOSED "rate-limited: ...".
	EventRate   float64 // EVENTs per second per connection
	EventBurst  int     // default 100
	ReqRate     float64 // REQ+COUNT per second per connection
	ReqBurst    int     // default 50
	IPEventRate float64 // EVENTs per second per client IP (burst: EventBurst)
	IPReqRate   float64 // REQ+COUNT per second per client IP (burst: ReqBurst)
	Logger      *slog.Logger
}

// Fixed limits that need no knob; advertised in NIP-11 where a client can run into them.
const (
	maxSubIDLength = 64 // NIP-01, in characters
	// maxEchoedSubIDBytes: a refused over-long subscription id is echoed in its CLOSED up to this
	// size (64 characters of 4 bytes, with room to spare); a longer one gets a NOTICE.
	maxEchoedSubIDBytes = 1024
	maxFilterValues     = 1000 // per ids/authors/kinds/#x list of one filter: a "huge filter" beyond this is refused
	// maxConnFilterValues bounds the values all live subscriptions of one connection list together
	// (32 subscriptions × 16 filters × 1,000 values would be 512,000 to check per event).
	maxConnFilterValues = 10000
	maxAuthPubkeys      = 16 // pubkeys authenticated on one connection
	// maxDeletionTargets bounds the e and a tags of one kind 5 (see deletionTargets): with the
	// default 16 acceptance connections a process holds at most about 1,600 such locks, a fifth of
	// a stock server's lock table (64 x 122 entries).
	maxDeletionTargets = 100
	maxLimitedStreak   = 1000 // rate-limited refusals in a row before the connection is closed
	authWindow         = 10 * time.Minute
	acceptTimeout      = 15 * time.Second
	writeWait          = 10 * time.Second // one frame must leave within this, or the peer is dead/stuck
	writeBatch         = 256 << 10        // bytes written per deadline: a reader slower than 25.6 KB/s is stuck
	pongWait           = 75 * time.Second // read deadline, renewed by any frame from the client and by each full write batch it takes while more is queued
	pingPeriod         = 30 * time.Second
	slowCloseGrace     = 2 * time.Second // after a send-queue overflow, how long the NOTICE + close frame may take
	seenPerSub         = 4096            // live de-dup ids remembered per subscription (FIFO) until its EOSE
	seenAfterEOSE      = 1024            // and after it (what can still repeat: one event stored again, or sent to two processes)
	sentLiveMax        = 65536           // ids delivered live while a REQ's query runs, kept until its rows are sent
	sentRowsMax        = 4096            // initial row ids kept for a REQ's limit-0 filters while its snapshot is held
	duePerConn         = 1024            // (id, stamp) due signals remembered per connection
	memberCacheSize    = 65536           // channels whose member set is cached
	memberLookupWait   = 3 * time.Second
	// maxInitialBytes bounds what one REQ's initial query holds in memory before sending; the
	// oldest rows beyond it are dropped (NIP-01 lets a relay return fewer than limit).
	maxInitialBytes = 16 << 20
)

func (c *Config) applyDefaults() error {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&c.MaxMessageLength, 131072)
	def(&c.MaxSubscriptions, 32)
	def(&c.MaxSubscriptionsPerIP, 4096)
	def(&c.MaxSubscriptionsTotal, 100000)
	def(&c.InboxEvents, 8192)
	def(&c.InboxEventsPerIP, 32768)
	if c.DeliveryRatePerIP == 0 {
		c.DeliveryRatePerIP = 20000
	}
	def(&c.DeliveryBurstPerIP, 2000)
	if c.DedupBytes <= 0 {
		c.DedupBytes = 256 << 20
	}
	def(&c.MaxFilters, 16)
	def(&c.MaxLimit, 5000)
	def(&c.DefaultLimit, 500)
	def(&c.MaxEventTags, 2000)
	def(&c.MaxContentLength, 65536)
	def(&c.SendQueueBytes, 4<<20)
	def(&c.MaxConns, 10000)
	def(&c.MaxConnsPerIP, 1000)
	def(&c.MaxQueriesInFlight, 4)
	def(&c.AcceptBatch, 32)
	def(&c.AcceptBatchCalls, 1)
	def(&c.EventWindow, 64)
	def(&c.EventWindowBytes, 1<<20)
	if c.InitialResultBudget <= 0 {
		c.InitialResultBudget = 256 << 20
	}
	if c.SendBudget <= 0 {
		c.SendBudget = 1 << 30
	}
	if c.SendClientShare <= 0 {
		c.SendClientShare = max(c.SendBudget/4, int64(c.SendQueueBytes))
	}
	if c.InitialResultPerConn <= 0 {
		c.InitialResultPerConn = 2 * maxInitialBytes
	}
	if c.InitialResultPerIP <= 0 {
		// Never below one connection's share: with a budget set smaller than two shares, the
		// budget itself is the bound, not a client's half of it.
		c.InitialResultPerIP = max(c.InitialResultBudget/2, c.InitialResultPerConn)
	}
	def(&c.EventBurst, 100)
	def(&c.ReqBurst, 50)
	if c.MaxFutureSeconds <= 0 {
		c.MaxFutureSeconds = 900
	}
	if c.QueryTimeout <= 0 {
		c.QueryTimeout = 5 * time.Second
	}
	if c.ReminderHorizon <= 0 {
		c.ReminderHorizon = 365 * 24 * time.Hour
	}
	if c.DefaultLimit > c.MaxLimit {
		c.DefaultLimit = c.MaxLimit
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.SendQueueBytes < c.MaxMessageLength {
		// A queue smaller than one full event would refuse a reply to a maximal EVENT whenever
		// anything else is queued (an empty queue takes one message of any size: push).
		return errors.New("relay: SendQueueBytes must be at least MaxMessageLength")
	}
	if c.SendBudget < int64(c.SendQueueBytes) || c.SendClientShare > c.SendBudget {
		// A budget below one queue's bound would close readers whose own queue is within it.
		return errors.New("relay: SendBudget must be at least SendQueueBytes, and SendClientShare at most SendBudget")
	}
	return nil
}
