package fanout

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/evt"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// delivery is what a test sink received: an event, or a due signal (due, with its stamp).
type delivery struct {
	evt.Delivery
	due   bool
	stamp int64
}

// key is the delivery's de-duplication key: the event id, or dueKey.
func (d delivery) key() string {
	if d.due {
		return dueKey(evt.Due{Event: d.Event, Stamp: d.stamp})
	}
	return d.Event.ID
}

// recSink records every delivery; waiters are woken on each one.
type recSink struct {
	mu        sync.Mutex
	cond      *sync.Cond
	byKey     map[string]int
	all       []delivery
	onDeliver func(delivery)
	// resets holds, for each stream restart (forget every member set and every snapshot), how many
	// deliveries came before it.
	resets []int
}

func newRecSink() *recSink {
	s := &recSink{byKey: map[string]int{}}
	s.cond = sync.NewCond(&s.mu)
	return s
}

func (s *recSink) DeliverEvent(d evt.Delivery) { s.record(delivery{Delivery: d}) }

func (s *recSink) DeliverDue(d evt.Due) {
	s.record(delivery{Delivery: evt.Delivery{Event: d.Event, CommitLSN: d.CommitLSN}, due: true, stamp: d.Stamp})
}

func (s *recSink) MembersChanged(evt.MembersChange) {}

func (s *recSink) StreamRestarted() {
	s.mu.Lock()
	s.resets = append(s.resets, len(s.all))
	s.mu.Unlock()
}

func (s *recSink) record(d delivery) {
	if s.onDeliver != nil {
		s.onDeliver(d)
	}
	s.mu.Lock()
	s.byKey[d.key()]++
	s.all = append(s.all, d)
	s.cond.Broadcast()
	s.mu.Unlock()
}

func (s *recSink) count(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.byKey[key]
}

func (s *recSink) get(key string) (delivery, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.all {
		if d.key() == key {
			return d, true
		}
	}
	return delivery{}, false
}

// waitAll waits until every key was delivered at least once (a deadline turns a hang into a
// failure; it is not a timing assumption).
func (s *recSink) waitAll(t testing.TB, keys []string, timeout time.Duration) {
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
func (s *recSink) assertExactlyOnce(t testing.TB, keys []string) {
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

var instSeq int

// instanceID returns an instance id unique across the cluster (slot names are cluster-wide
// and other test binaries share the server).
func instanceID(prefix string) string {
	instSeq++
	return fmt.Sprintf("%s_%d_%d", prefix, time.Now().UnixNano()%1e9, instSeq)
}

type harness struct {
	t    testing.TB
	url  string
	pool *pgxpool.Pool
}

func newHarness(t testing.TB) *harness { return newHarnessAt(t, testenv.FreshDB(t)) }

// newHarnessAt works on the migrated database at url (e.g. on a private cluster).
func newHarnessAt(t testing.TB, url string) *harness {
	return &harness{t: t, url: url, pool: testenv.Pool(t, url)}
}

// start runs a Fanout and waits until its stream is attached. Cleanup closes it (dropping the
// slot) unless the test already did.
func (h *harness) start(cfg Config, sink evt.Sink, prep func(*Fanout)) (*Fanout, context.CancelFunc) {
	h.t.Helper()
	cfg.DatabaseURL = h.url
	if cfg.InstanceID == "" {
		cfg.InstanceID = instanceID("lt")
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(h.t, slog.LevelDebug, nil)
	}
	f := New(cfg, h.pool, sink)
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
	testSK   = nostr.GeneratePrivateKey()
	nonceSeq atomic.Int64
)

// signed returns a new signed event; a nonce tag makes every call a distinct event even within
// one second.
func signedEvent(kind int, content string, tags nostr.Tags) *nostr.Event {
	tags = append(append(nostr.Tags{}, tags...), nostr.Tag{"nonce", strconv.FormatInt(nonceSeq.Add(1), 10)})
	ev := &nostr.Event{Kind: kind, Content: content, Tags: tags, CreatedAt: nostr.Now()}
	if err := ev.Sign(testSK); err != nil {
		panic(err)
	}
	return ev
}

// accept stores (or, for ephemeral kinds, emits) ev through buzz.accept_event, as the relay does.
func (h *harness) accept(ctx context.Context, ev *nostr.Event) {
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
func (h *harness) emit(ctx context.Context, payload any) {
	h.t.Helper()
	b, _ := json.Marshal(payload)
	if _, err := h.pool.Exec(ctx, `SELECT pg_logical_emit_message(true, 'buzz', $1::text)`, string(b)); err != nil {
		h.t.Fatalf("emit: %v", err)
	}
}

// walsenderPID finds the walsender of an instance by its replication application_name.
func (h *harness) walsenderPID(ctx context.Context, instance string) int {
	var pid int
	_ = h.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND backend_type = 'walsender'`,
		ApplicationName(instance)).Scan(&pid)
	return pid
}

func (h *harness) slotExists(ctx context.Context, slot string) bool {
	var n int
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&n); err != nil {
		h.t.Fatal(err)
	}
	return n > 0
}
