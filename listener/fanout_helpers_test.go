package listener

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// fanRecSink records every delivery; waiters are woken on each one.
type fanRecSink struct {
	mu        sync.Mutex
	cond      *sync.Cond
	byKey     map[string]int
	all       []evt.Delivery
	onDeliver func(evt.Delivery)
	// resets holds, for each stream reset (forget every member set and every snapshot), how many
	// deliveries came before it.
	resets []int
}

func newFanRecSink() *fanRecSink {
	s := &fanRecSink{byKey: map[string]int{}}
	s.cond = sync.NewCond(&s.mu)
	return s
}

func (s *fanRecSink) Deliver(d evt.Delivery) {
	if d.Members != nil {
		if d.Members.All && d.Reset { // not an event
			s.mu.Lock()
			s.resets = append(s.resets, len(s.all))
			s.mu.Unlock()
		}
		return
	}
	if s.onDeliver != nil {
		s.onDeliver(d)
	}
	s.mu.Lock()
	s.byKey[fanDedupeKey(d)]++
	s.all = append(s.all, d)
	s.cond.Broadcast()
	s.mu.Unlock()
}

func (s *fanRecSink) count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byKey[key]
}

func (s *fanRecSink) get(key string) (evt.Delivery, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.all {
		if fanDedupeKey(d) == key {
			return d, true
		}
	}
	return evt.Delivery{}, false
}

// waitAll waits until every key was delivered at least once (a deadline turns a hang into a
// failure; it is not a timing assumption).
func (s *fanRecSink) waitAll(t testing.TB, keys []string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { s.mu.Lock(); s.cond.Broadcast(); s.mu.Unlock() })
	defer timer.Stop()
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		var missing []string
		for _, k := range keys {
			if s.byKey[k] == 0 {
				missing = append(missing, k)
			}
		}
		if len(missing) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d deliveries missing after %s (first: %s)", len(missing), len(keys), timeout, missing[0])
		}
		s.cond.Wait()
	}
}

// assertOnce fails for every key not delivered exactly once, and for deliveries of unknown keys.
func (s *fanRecSink) assertExactlyOnce(t testing.TB, keys []string) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	want := map[string]bool{}
	for _, k := range keys {
		want[k] = true
		if n := s.byKey[k]; n != 1 {
			t.Errorf("%s delivered %d times, want 1", k, n)
		}
	}
	var extra []string
	for k := range s.byKey {
		if !want[k] {
			extra = append(extra, k)
		}
	}
	sort.Strings(extra)
	if len(extra) > 0 {
		t.Errorf("unexpected deliveries: %v", extra)
	}
}

// fanLogBuf captures log records for assertions.
type fanLogBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *fanLogBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}
func (l *fanLogBuf) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }

func fanLogger(t testing.TB, extra *fanLogBuf) *slog.Logger {
	w := &fanTLogWriter{t: t, extra: extra}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type fanTLogWriter struct {
	t     testing.TB
	extra *fanLogBuf
}

func (w *fanTLogWriter) Write(p []byte) (int, error) {
	if w.extra != nil {
		w.extra.Write(p)
	}
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

var fanInstSeq int

// fanInstance returns an instance id unique across the cluster (slot names are cluster-wide
// and other test binaries share the server).
func fanInstance(prefix string) string {
	fanInstSeq++
	return fmt.Sprintf("%s_%d_%d", prefix, time.Now().UnixNano()%1e9, fanInstSeq)
}

type fanHarness struct {
	t    testing.TB
	url  string
	pool *pgxpool.Pool
}

func newFanHarness(t testing.TB) *fanHarness { return newFanHarnessAt(t, testenv.FreshDB(t)) }

// newFanHarnessAt works on the migrated database at url (e.g. on a private cluster).
func newFanHarnessAt(t testing.TB, url string) *fanHarness {
	return &fanHarness{t: t, url: url, pool: testenv.Pool(t, url)}
}

// start runs a Fanout and waits until its stream is attached. Cleanup closes it (dropping the
// slot) unless the test already did.
func (h *fanHarness) start(cfg FanoutConfig, sink evt.Sink, prep func(*Fanout)) (*Fanout, context.CancelFunc) {
	h.t.Helper()
	cfg.DatabaseURL = h.url
	if cfg.InstanceID == "" {
		cfg.InstanceID = fanInstance("lt")
	}
	if cfg.Logger == nil {
		cfg.Logger = fanLogger(h.t, nil)
	}
	f := NewFanout(cfg, h.pool, sink)
	if prep != nil {
		prep(f)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- f.Run(ctx) }()
	h.t.Cleanup(func() {
		cancel()
		cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer ccancel()
		_ = f.Close(cctx)
	})
	testenv.WaitUntil(h.t, 30*time.Second, "fan-out attached", f.Ready)
	return f, cancel
}

var (
	fanSK       = nostr.GeneratePrivateKey()
	fanNonceSeq atomic.Int64
)

// signed returns a new signed event; a nonce tag makes every call a distinct event even within
// one second.
func fanSigned(kind int, content string, tags nostr.Tags) *nostr.Event {
	tags = append(append(nostr.Tags{}, tags...), nostr.Tag{"nonce", strconv.FormatInt(fanNonceSeq.Add(1), 10)})
	ev := &nostr.Event{Kind: kind, Content: content, Tags: tags, CreatedAt: nostr.Now()}
	if err := ev.Sign(fanSK); err != nil {
		panic(err)
	}
	return ev
}

// accept stores (or, for ephemeral kinds, emits) ev through buzz.accept_event, as the relay does.
func (h *fanHarness) accept(ctx context.Context, ev *nostr.Event) {
	h.t.Helper()
	b, _ := json.Marshal(ev)
	var ok bool
	var msg string
	if err := h.pool.QueryRow(ctx, `SELECT ok, message FROM buzz.accept_event($1::jsonb)`, string(b)).Scan(&ok, &msg); err != nil {
		h.t.Fatalf("accept_event: %v", err)
	}
	if !ok {
		h.t.Fatalf("accept_event refused %s: %s", ev.ID, msg)
	}
}

// emit sends a 'buzz' logical message in its own transaction.
func (h *fanHarness) emit(ctx context.Context, payload any) {
	h.t.Helper()
	b, _ := json.Marshal(payload)
	if _, err := h.pool.Exec(ctx, `SELECT pg_logical_emit_message(true, 'buzz', $1::text)`, string(b)); err != nil {
		h.t.Fatalf("emit: %v", err)
	}
}

// walsenderPID finds the walsender of an instance by its replication application_name.
func (h *fanHarness) walsenderPID(ctx context.Context, instance string) int {
	var pid int
	_ = h.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND backend_type = 'walsender'`,
		ApplicationName(instance)).Scan(&pid)
	return pid
}

func (h *fanHarness) slotExists(ctx context.Context, slot string) bool {
	var n int
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n > 0
}
