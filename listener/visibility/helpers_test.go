package visibility

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// env is one isolated database with a relay key recorded in buzz.config and an audit table
// that records every snapshot insert (viewer, generation, created_at, hidden set) in commit order
// per viewer (publications of one viewer serialise on its state row lock).
type env struct {
	t       testing.TB
	url     string
	pool    *pgxpool.Pool
	sk, pk  string
	logs    *testenv.LogBuf
	counter int
}

func newEnv(t testing.TB) *env {
	t.Helper()
	url := testenv.FreshDB(t)
	e := &env{t: t, url: url, pool: testenv.Pool(t, url), logs: &testenv.LogBuf{}}
	e.sk, e.pk = testenv.NewKey()
	e.setRelayKey(e.pk)
	testenv.SnapshotAudit(t, e.pool)
	return e
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("exec %q: %v", sql, err)
	}
}

func (e *env) setRelayKey(pk string) {
	e.t.Helper()
	e.exec(`UPDATE buzz.config SET value = $1 WHERE key = 'relay_pubkey'`, pk)
}

// dm opens the DM of viewer and a new other participant and returns its channel id and the other.
func (e *env) dm(viewer string) (channel, other string) {
	e.t.Helper()
	_, other = testenv.NewKey()
	if err := e.pool.QueryRow(context.Background(),
		`SELECT channel_id::text FROM buzz.open_dm($1, ARRAY[$2], NULL)`, viewer, other).Scan(&channel); err != nil {
		e.t.Fatal(err)
	}
	return channel, other
}

// hiddenViewer is a fresh viewer with one DM, hidden: generation 1, pending.
func (e *env) hiddenViewer() (viewer, channel string) {
	e.t.Helper()
	_, viewer = testenv.NewKey()
	channel, _ = e.dm(viewer)
	e.hide(viewer, channel)
	return viewer, channel
}

func (e *env) hide(viewer, channel string) {
	e.t.Helper()
	e.exec(`SELECT buzz.hide_dm($1, $2::uuid)`, viewer, channel)
}

func (e *env) unhide(viewer, channel string) {
	e.t.Helper()
	e.exec(`SELECT buzz.unhide_dm($1, $2::uuid)`, viewer, channel)
}

func (e *env) dbNow() int64 {
	e.t.Helper()
	var n int64
	if err := e.pool.QueryRow(context.Background(), `SELECT buzz.now_unix()`).Scan(&n); err != nil {
		e.t.Fatal(err)
	}
	return n
}

type genPair struct{ target, published int64 }

// gens returns the viewer's generations, zero for a viewer with no state row yet; any other
// query error fails the test (it must not read as 0/0, which is "converged").
func (e *env) gens(viewer string) genPair {
	e.t.Helper()
	var g genPair
	err := e.pool.QueryRow(context.Background(), `SELECT target_generation, published_generation
		FROM buzz.visibility_state WHERE viewer = $1`, viewer).Scan(&g.target, &g.published)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		e.t.Fatalf("generations of %s: %v", viewer[:8], err)
	}
	return g
}

// hiddenSet is the viewer's hidden channel ids according to the members table.
func (e *env) hiddenSet(viewer string) []string {
	e.t.Helper()
	var hs []string
	if err := e.pool.QueryRow(context.Background(), `SELECT coalesce(array_agg(channel_id::text ORDER BY channel_id), '{}')
		FROM buzz.members WHERE pubkey = $1 AND hidden_at IS NOT NULL`, viewer).Scan(&hs); err != nil {
		e.t.Fatal(err)
	}
	return hs
}

// head returns the viewer's only stored 30622 (failing when there are several) with its h set.
func (e *env) head(viewer string) (*nostr.Event, []string) {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `SELECT id, pubkey, created_at, kind, tags, content, sig
		FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, viewer)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var evs []*nostr.Event
	for rows.Next() {
		var ev nostr.Event
		var created int64
		var tags []byte
		if err := rows.Scan(&ev.ID, &ev.PubKey, &created, &ev.Kind, &tags, &ev.Content, &ev.Sig); err != nil {
			e.t.Fatal(err)
		}
		ev.CreatedAt = nostr.Timestamp(created)
		if err := json.Unmarshal(tags, &ev.Tags); err != nil {
			e.t.Fatal(err)
		}
		evs = append(evs, &ev)
	}
	if len(evs) == 0 {
		return nil, nil
	}
	if len(evs) > 1 {
		e.t.Fatalf("viewer %s has %d snapshot heads", viewer[:8], len(evs))
	}
	ev := evs[0]
	if ok, _ := ev.CheckSignature(); !ok || !ev.CheckID() {
		e.t.Fatalf("snapshot head %s has a bad id or signature", ev.ID)
	}
	hs := []string{}
	for _, t := range ev.Tags {
		if t[0] == "h" {
			hs = append(hs, t[1])
		}
	}
	sort.Strings(hs)
	return ev, hs
}

// assertConverged checks published = target and head content = hidden set.
func (e *env) assertConverged(viewer string) {
	e.t.Helper()
	g := e.gens(viewer)
	if g.published != g.target {
		e.t.Fatalf("viewer %s: published %d, target %d", viewer[:8], g.published, g.target)
	}
	ev, hs := e.head(viewer)
	want := e.hiddenSet(viewer)
	if ev == nil && len(want) > 0 {
		e.t.Fatalf("viewer %s: no snapshot, hidden %v", viewer[:8], want)
	}
	if ev != nil && !slices.Equal(hs, want) {
		e.t.Fatalf("viewer %s: snapshot says %v, hidden set is %v", viewer[:8], hs, want)
	}
}

// waitConverged waits (bounded: the deadline only turns a hang into a failure) until every viewer
// has published = target, then checks the content.
func (e *env) waitConverged(viewers []string, timeout time.Duration) {
	e.t.Helper()
	testenv.WaitUntil(e.t, timeout, "snapshots converged", func() bool {
		return testenv.MustInt(e.t, e.pool, `SELECT count(*) FROM buzz.visibility_state
			WHERE viewer = ANY($1) AND published_generation < target_generation`, viewers) == 0
	})
	for _, v := range viewers {
		e.assertConverged(v)
	}
}

// assertAuditMonotonic: per viewer, every publication has a higher generation and a higher
// created_at than the one before it (no generation published twice, none regresses; I3, I4).
func (e *env) assertAuditMonotonic() (publications int) {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(),
		`SELECT viewer, generation, created_at FROM public.snapshot_audit ORDER BY viewer, seq`)
	if err != nil {
		e.t.Fatal(err)
	}
	defer rows.Close()
	var lastV string
	var lastG, lastC int64
	for rows.Next() {
		var v string
		var g, c int64
		if err := rows.Scan(&v, &g, &c); err != nil {
			e.t.Fatal(err)
		}
		publications++
		if v == lastV {
			if g <= lastG {
				e.t.Errorf("viewer %s: generation %d published after %d", v[:8], g, lastG)
			}
			if c <= lastC {
				e.t.Errorf("viewer %s: created_at %d published after %d", v[:8], c, lastC)
			}
		}
		lastV, lastG, lastC = v, g, c
	}
	return publications
}

// publisher makes a publisher on the env's pool; start runs it until the test ends.
func (e *env) publisher(instance string, mod func(*Config)) *Publisher {
	cfg := Config{
		InstanceID:     instance,
		RelaySecretKey: e.sk,
		SweepInterval:  time.Hour, // tests that rely on the periodic sweep say so
		Lease:          30 * time.Second,
		BackoffBase:    5 * time.Millisecond,
		BackoffMax:     50 * time.Millisecond,
		DatabaseURL:    e.url,
		Logger:         testenv.Logger(e.t, slog.LevelInfo, e.logs),
	}
	if mod != nil {
		mod(&cfg)
	}
	return NewPublisher(cfg, e.pool)
}

func (e *env) start(p *Publisher) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				e.t.Errorf("publisher %s Run: %v", p.cfg.InstanceID, err)
			}
			cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer ccancel()
			if err := p.Close(cctx); err != nil {
				e.t.Errorf("publisher %s Close: %v", p.cfg.InstanceID, err)
			}
		})
	}
	e.t.Cleanup(stop)
	testenv.WaitUntil(e.t, 10*time.Second, "publisher listening", p.listening)
	return stop
}

// signedSnapshot builds and signs a snapshot with key sk (what a publisher would send).
func signedSnapshot(t testing.TB, sk, viewer string, hidden []string, createdAt int64) *nostr.Event {
	t.Helper()
	ev := BuildSnapshot(viewer, hidden, createdAt)
	if err := ev.Sign(sk); err != nil {
		t.Fatal(err)
	}
	return ev
}

// pauseAt stops the first pass of publisher instance (any component when "") at hook point name.
func pauseAt(t testing.TB, name, instance string) *testenv.Gate {
	return testenv.PauseAt(t, name, func(ctx context.Context) bool {
		return instance == "" || publisherInstance(ctx) == instance
	})
}

func short(s string) string { return fmt.Sprintf("%.8s", s) }

// viewerWithTwoDMs is a new viewer with two DMs, x and y, neither hidden.
func (e *env) viewerWithTwoDMs() (viewer, x, y string) {
	e.t.Helper()
	_, viewer = testenv.NewKey()
	x, _ = e.dm(viewer)
	y, _ = e.dm(viewer)
	return viewer, x, y
}

// publishResult is what a PublishViewer running in the background returned.
type publishResult struct {
	out string
	err error
}

// pausedPublisher starts publisher instance name on viewer in the background and returns once it
// is held at HookBeforeFence, its source read: the gate lets it go on, done gets its outcome.
func (e *env) pausedPublisher(name, viewer string) (p *Publisher, g *testenv.Gate, done <-chan publishResult) {
	e.t.Helper()
	p = e.publisher(name, nil)
	g = pauseAt(e.t, HookBeforeFence, name)
	ch := make(chan publishResult, 1)
	go func() { o, err := p.PublishViewer(context.Background(), viewer); ch <- publishResult{o, err} }()
	g.Wait(e.t)
	return p, g, ch
}

// tracedPool is a pool of at most maxConns connections to url whose queries tracer sees (tests
// that wait for a given statement, or order on one).
func tracedPool(t *testing.T, url string, maxConns int32, tracer pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	pcfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	pcfg.MaxConns = maxConns
	pcfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}
