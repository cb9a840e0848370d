// Package relay is buzzpg's WebSocket side: NIP-01 framing, NIP-11, NIP-42 AUTH, NIP-45 COUNT,
// NIP-70, filters compiled to SQL with the read gates inside, live subscriptions fed by Deliver,
// and per-connection limits. Acceptance is one SQL call (buzz.accept_event); live delivery comes
// only through Deliver, which the logical-replication tail calls for every event of every process.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gorilla/websocket"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/logx"
	"github.com/buzzpg/buzzpg/internal/metrics"
	"github.com/buzzpg/buzzpg/internal/store"
)

// Server is the relay. It is an http.Handler (mount it at "/") and an evt.Sink.
type Server struct {
	cfg           Config
	accept        *pgxpool.Pool // buzz.accept_event and Deliver's member-set lookups: short queries only
	batcher       *store.Batcher
	query         *pgxpool.Pool // REQ/COUNT and their gate lookups: may be saturated by expensive filters
	log           *slog.Logger
	relayPubkey   string
	nip11         []byte
	upgrader      websocket.Upgrader
	members       *memberCache
	timeoutSet    sync.Map // *pgconn.PgConn of query-pool connections whose statement_timeout is set
	timeoutSetLen atomic.Int64
	ipEvents      *ipLimiter // nil: unlimited
	ipReqs        *ipLimiter
	initial       byteBudget // initial REQ results held until sent, across connections
	recent        recentStored
	ephemeral     recentEphemeral // ephemeral ids accepted lately, answered duplicate: when sent again
	ipInitial     *ipBytes        // the same per client IP (InitialResultPerIP)
	sends         *sendBudget     // bytes in send queues, across connections and per client IP
	ipSubs        *ipSlots        // live subscriptions per client IP (MaxSubscriptionsPerIP)
	allSubs       *ipSlots        // live subscriptions of the process, under one key (MaxSubscriptionsTotal)
	dedup         *dedupBudget    // ids held by the subscriptions' de-dup windows (DedupBytes)
	ipInbox       *ipCounts       // live deliveries waiting in inboxes per client IP (InboxEventsPerIP)
	shares        *deliveryShares // what live delivery one client IP gets (DeliveryRatePerIP)
	ipQueries     *ipQueries      // REQ/COUNT queries (and gate lookups) in flight per client IP
	acceptErrLog  logx.Sampler

	mu       sync.RWMutex
	conns    map[*conn]struct{}
	byPubkey authIndex      // conns by authenticated pubkey (recipients.go)
	interest *interest      // live filters by the h values and kinds they need (interest.go)
	admitted int            // connection slots taken (admission.go), upgrades in progress included
	perIP    map[string]int // the same per client IP
	connWG   sync.WaitGroup
	closing  atomic.Bool
	nextID   atomic.Uint64

	memberWait time.Duration // how long one member-set lookup may take (memberLookupWait)
	readWait   time.Duration // read deadline of a connection (pongWait)
	pingEvery  time.Duration // how often the relay pings a connection (pingPeriod)
	writeWait  time.Duration // how long one write may take before the client counts as stuck (writeWait)
	// lookup serves live delivery's member-set lookups (SetLookupPool); the acceptance pool
	// until set.
	lookup *pgxpool.Pool

	// stop ends when Shutdown begins: work that would otherwise wait or retry gives up.
	stop     context.Context
	stopWork context.CancelFunc
	// halt ends when Shutdown kills the connections still open: it ends the acceptance calls in
	// flight, which run for several connections at once and so under none's context.
	halt      context.Context
	haltCalls context.CancelFunc

	// onConnClosed, when set (in-package tests), is called after a connection is torn down.
	onConnClosed func(c *conn, reason string)
	// onLookupRetry, when set (in-package tests), is called after a failed delivery lookup.
	onLookupRetry func()
	// onSettled, when set (in-package tests), is called when a run of settleSoon ends.
	onSettled func()

	// settleSoon's single flight: one check of the pending forgets at a time, and one more for
	// forgets announced while it ran.
	settleMu      sync.Mutex
	settleRun     chan struct{} // closed when the running check's goroutine returns; nil: none
	settleAgain   bool
	settleStopped bool
}

var _ evt.Sink = (*Server)(nil)

// SetLookupPool gives live delivery its own connections for member-set lookups (call before
// serving). On the acceptance pool they queue behind a flood of EVENTs, and the one fan-out
// goroutine, and so live delivery to everyone, waits with them.
func (s *Server) SetLookupPool(p *pgxpool.Pool) { s.lookup = p }

// New builds a Server. acceptPool serves buzz.accept_event; queryPool serves REQ/COUNT, so a flood
// of expensive filters cannot stall acceptance.
func New(cfg Config, acceptPool, queryPool *pgxpool.Pool) (*Server, error) {
	if acceptPool == nil || queryPool == nil {
		return nil, errors.New("relay: both pools are required")
	}
	if err := cfg.applyDefaults(); err != nil {
		return nil, err
	}
	s := &Server{
		cfg:      cfg,
		accept:   acceptPool,
		query:    queryPool,
		log:      cfg.Logger.With("component", "relay"),
		conns:    map[*conn]struct{}{},
		byPubkey: authIndex{},
		interest: newInterest(),
		perIP:    map[string]int{},
	}
	s.stop, s.stopWork = context.WithCancel(context.Background())
	s.memberWait = memberLookupWait
	s.readWait = pongWait
	s.writeWait = writeWait
	s.pingEvery = pingPeriod
	s.lookup = acceptPool
	s.halt, s.haltCalls = context.WithCancel(context.Background())
	s.batcher = store.NewBatcher(s.halt, acceptPool, cfg.AcceptBatch, cfg.AcceptBatchCalls, acceptTimeout)
	if cfg.RelaySecretKey != "" {
		pk, err := nostr.GetPublicKey(cfg.RelaySecretKey)
		if err != nil {
			return nil, errors.New("relay: invalid RelaySecretKey")
		}
		s.relayPubkey = pk
	}
	s.initial.limit = cfg.InitialResultBudget
	s.ipInitial = newPerClient[int64](cfg.InitialResultPerIP)
	s.sends = newSendBudget(cfg.SendBudget, cfg.SendClientShare)
	s.ipSubs = newPerClient(cfg.MaxSubscriptionsPerIP)
	s.allSubs = newPerClient(cfg.MaxSubscriptionsTotal)
	s.dedup = newDedupBudget(cfg.DedupBytes)
	s.ipInbox = newPerClient(cfg.InboxEventsPerIP)
	s.shares = newDeliveryShares(cfg.DeliveryRatePerIP, cfg.DeliveryBurstPerIP, deliverySlots())
	metrics.SetSendQueued(s.sends.total.Load)
	if cfg.MaxQueriesPerIP <= 0 {
		cfg.MaxQueriesPerIP = max(1, int(queryPool.Config().MaxConns)/2)
		s.cfg.MaxQueriesPerIP = cfg.MaxQueriesPerIP
	}
	s.ipQueries = newIPQueries(cfg.MaxQueriesPerIP)
	s.acceptErrLog.Every = 10 * time.Second
	s.members = newMemberCache(memberCacheSize, s.log)
	s.ipEvents = newIPLimiter(cfg.IPEventRate, cfg.EventBurst)
	s.ipReqs = newIPLimiter(cfg.IPReqRate, cfg.ReqBurst)
	s.upgrader = websocket.Upgrader{
		ReadBufferSize:  8192,
		WriteBufferSize: 16384,
		// Nostr clients run in browsers on any origin; there are no cookies to protect.
		CheckOrigin: func(*http.Request) bool { return true },
	}
	doc, err := s.buildNIP11()
	if err != nil {
		return nil, err
	}
	s.nip11 = doc
	return s, nil
}

// RelayPubkey is the hex pubkey of the relay key ("" when none was configured).
func (s *Server) RelayPubkey() string { return s.relayPubkey }

// ServeHTTP upgrades WebSocket requests at "/" and answers NIP-11 on Accept: application/nostr+json.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/" {
		http.NotFound(w, r)
		return
	}
	if websocket.IsWebSocketUpgrade(r) {
		if s.closing.Load() {
			http.Error(w, "relay shutting down", http.StatusServiceUnavailable)
			return
		}
		ip := s.clientIP(r)
		key := limitKey(ip)
		if !s.admit(w, key) {
			return
		}
		ws, err := s.upgrader.Upgrade(w, r, nil)
		if err != nil {
			s.unadmit(key)
			return // the upgrader already answered with an HTTP error
		}
		s.serveConn(ws, r, ip, key)
		return
	}
	if strings.Contains(r.Header.Get("Accept"), "application/nostr+json") || r.Method == http.MethodOptions {
		s.serveNIP11(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = w.Write([]byte("buzzpg nostr relay: connect with a WebSocket client, or ask for Accept: application/nostr+json\n"))
}

// serveConn runs an upgraded connection that holds an admission slot for key (limitKey of ip).
func (s *Server) serveConn(ws *websocket.Conn, r *http.Request, ip, key string) {
	c := newConn(s, ws, r, s.cfg.RelayURL, ip, key)
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		_ = ws.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseGoingAway, "relay shutting down"), timeNow().Add(writeWait))
		_ = ws.Close()
		c.q.release()
		s.unadmit(key)
		return
	}
	s.conns[c] = struct{}{}
	s.connWG.Add(1)
	s.mu.Unlock()
	metrics.Connections.Inc()
	// The handler goroutine becomes the read loop; returning from ServeHTTP is fine after hijack.
	c.run()
}

func (s *Server) removeConn(c *conn, reason string) {
	s.mu.Lock()
	_, ok := s.conns[c]
	delete(s.conns, c)
	s.unindexAuth(c)
	s.mu.Unlock()
	if ok {
		s.unadmit(c.ip)
		metrics.Connections.Dec()
		if f := s.onConnClosed; f != nil {
			f(c, reason)
		}
		s.connWG.Done()
	}
}

// ConnCount is the number of open WebSocket connections.
func (s *Server) ConnCount() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.conns)
}

func (s *Server) snapshotConns() []*conn {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]*conn, 0, len(s.conns))
	for c := range s.conns {
		out = append(out, c)
	}
	return out
}

// Shutdown stops accepting connections, tells every client (NOTICE, then close frame 1001) and
// waits for connections to finish until ctx ends; then it cuts the rest.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closing.Store(true)
	s.stopWork()
	for _, c := range s.snapshotConns() {
		c.closeGracefully(websocket.CloseGoingAway, "relay shutting down", "error: relay shutting down")
	}
	settled := s.stopSettling()
	done := make(chan struct{})
	go func() { s.connWG.Wait(); <-settled; close(done) }()
	defer s.haltCalls()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.haltCalls()
		for _, c := range s.snapshotConns() {
			c.kill("shutdown deadline")
		}
		select {
		case <-done:
			return ctx.Err()
		case <-time.After(KillWait):
			n := len(s.snapshotConns())
			s.log.Warn("connections still running after their sockets were closed; shutting down without them",
				"connections", n, "waited", KillWait)
			return fmt.Errorf("%w: %d connections still running %s after their sockets were closed", ctx.Err(), n, KillWait)
		}
	}
}

// KillWait is how long Shutdown waits, once its context has ended and it has closed every
// connection's socket, for the connections' goroutines to return. They return at once: every wait
// they do ends with the connection's context or its socket. The cap is for one that does not (a
// bug): the process's shutdown has a documented bound (cmd/buzzpg/shutdown.go), and an orchestrator
// kills a process that overstays it, losing the claim and slot releases that come after this step.
const KillWait = time.Second
