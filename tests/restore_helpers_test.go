package tests

// Helpers of the restore drill (prefix drill): PostgreSQL's client programs, the drill's DMs with
// a model of every viewer's hidden set, and the probes its checks read.

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// drillBinDir is where scripts/pg.sh finds the server: its client programs are of the same major
// version (pg_dump refuses a newer server, and pg_restore reads what pg_dump of its version wrote).
func drillBinDir(t testing.TB) string {
	t.Helper()
	out, err := exec.Command(filepath.Join(testenv.RepoRoot(), "scripts", "pg.sh"), "bindir").Output()
	if err != nil {
		t.Fatalf("scripts/pg.sh bindir: %v", err)
	}
	return strings.TrimSpace(string(out))
}

// drillConn are the client-program arguments that reach cluster c as its superuser.
func drillConn(c *testenv.Cluster, more ...string) []string {
	return append([]string{"-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres"}, more...)
}

// drillRun runs a program to its end and returns what it printed; a non-zero exit fails the test.
func drillRun(t testing.TB, env []string, bin string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", filepath.Base(bin), strings.Join(args, " "), err, out)
	}
	return string(out)
}

// drillRearm arms a cross-process hook again after it was released, by the file protocol of
// internal/hooks: the process stops at its next pass and writes <name>.reached anew.
func drillRearm(t testing.TB, dir, name string) {
	t.Helper()
	for _, f := range []string{name + ".release", name + ".reached"} {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
	}
}

// drillDMs drives DMs over one connection authenticated as every participant and keeps the
// hidden set each viewer must end with (docs/protocol.md: hide, re-open, resurfacing).
type drillDMs struct {
	t       testing.TB
	c       *testenv.Client
	members map[string][]string        // channel id -> participant pubkeys
	hidden  map[string]map[string]bool // viewer -> channel id -> hidden
}

func newDrillDMs(t testing.TB, c *testenv.Client) *drillDMs {
	return &drillDMs{t: t, c: c, members: map[string][]string{}, hidden: map[string]map[string]bool{}}
}

func (m *drillDMs) set(viewer, ch string, hidden bool) {
	if m.hidden[viewer] == nil {
		m.hidden[viewer] = map[string]bool{}
	}
	m.hidden[viewer][ch] = hidden
}

// open sends a DM open (41010) by u naming the others: it creates the DM, or re-opens it for u.
func (m *drillDMs) open(u testenv.User, others ...testenv.User) string {
	m.t.Helper()
	tags := nostr.Tags{}
	pks := []string{u.PK}
	for _, o := range others {
		tags = append(tags, nostr.Tag{"p", o.PK})
		pks = append(pks, o.PK)
	}
	msg := m.c.MustPublish(u.Event(m.t, 41010, tags, ""))
	ch := testenv.DMChannelID(m.t, msg)
	m.members[ch] = pks
	m.set(u.PK, ch, false)
	return ch
}

// hide sends a DM hide (41012) by u.
func (m *drillDMs) hide(u testenv.User, ch string) {
	m.t.Helper()
	m.c.MustPublish(u.Event(m.t, 41012, nostr.Tags{{"h", ch}}, ""))
	m.set(u.PK, ch, true)
}

// say sends a message by u into ch: it resurfaces the DM for every other participant.
func (m *drillDMs) say(u testenv.User, ch string) {
	m.t.Helper()
	m.c.MustPublish(u.Event(m.t, 9, nostr.Tags{{"h", ch}}, "hello"))
	for _, pk := range m.members[ch] {
		if pk != u.PK {
			m.set(pk, ch, false)
		}
	}
}

// want is the hidden set the model holds for viewer, sorted.
func (m *drillDMs) want(viewer string) []string {
	hs := []string{}
	for ch, h := range m.hidden[viewer] {
		if h {
			hs = append(hs, ch)
		}
	}
	slices.Sort(hs)
	return hs
}

// drillTruth is viewer's hidden set as the database holds it (visibility_source, one snapshot).
func drillTruth(t testing.TB, pool *pgxpool.Pool, viewer string) []string {
	t.Helper()
	hs := testenv.MustScalar[[]string](t, pool, `SELECT coalesce(array_agg(h::text ORDER BY h::text), '{}')
		FROM buzz.visibility_source($1) s, unnest(s.hidden) h`, viewer)
	slices.Sort(hs)
	return hs
}

// drillHead is viewer's stored 30622 (id and signature checked): its hidden set and created_at;
// ok is false when there is none (no snapshot means nothing hidden).
func drillHead(t testing.TB, pool *pgxpool.Pool, viewer string) (hidden []string, createdAt int64, ok bool) {
	t.Helper()
	raws := testenv.MustColumn[[]byte](t, pool, `SELECT jsonb_build_object('id', id, 'pubkey', pubkey,
		  'created_at', created_at, 'kind', kind, 'tags', tags, 'content', content, 'sig', sig)
		FROM buzz.events WHERE kind = 30622 AND d_tag = $1`, viewer)
	switch len(raws) {
	case 0:
		return []string{}, 0, false
	case 1:
	default:
		t.Fatalf("viewer %.8s has %d snapshot heads", viewer, len(raws))
	}
	ev := &nostr.Event{}
	if err := ev.UnmarshalJSON(raws[0]); err != nil {
		t.Fatal(err)
	}
	if sigOK, _ := ev.CheckSignature(); !sigOK || !ev.CheckID() {
		t.Fatalf("snapshot %s of %.8s: bad id or signature", ev.ID, viewer)
	}
	return snapHidden(ev), int64(ev.CreatedAt), true
}

// drillLag is buzz.visibility_lag(): nothing pending, no outbox row missing, claimed or leased out.
type drillLag struct{ pending, missing, claimed, expired int64 }

func (l drillLag) zero() bool { return l == drillLag{} }

func drillReadLag(t testing.TB, pool *pgxpool.Pool) drillLag {
	t.Helper()
	var l drillLag
	testenv.MustScan(t, pool.QueryRow(context.Background(), `SELECT pending_viewers, missing_outbox, claimed,
		expired_leases FROM buzz.visibility_lag()`), &l.pending, &l.missing, &l.claimed, &l.expired)
	return l
}

// drillConverged waits until visibility_lag is zero and then checks that every viewer's head
// holds the viewer's hidden set; it returns each head's created_at (0: no head).
func drillConverged(t testing.TB, pool *pgxpool.Pool, viewers []string, timeout time.Duration) map[string]int64 {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for l := drillReadLag(t, pool); !l.zero(); l = drillReadLag(t, pool) {
		if time.Now().After(deadline) {
			detail := testenv.MustColumn[string](t, pool, `SELECT format('%s: generation %s, published %s, claimed %s',
				left(viewer, 8), target_generation, published_generation, claimed) FROM buzz.visibility_lag_detail(20)`)
			t.Fatalf("visibility_lag not zero after %s: %+v\n%s", timeout, l, strings.Join(detail, "\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	heads := map[string]int64{}
	for _, v := range viewers {
		hs, at, _ := drillHead(t, pool, v)
		if truth := drillTruth(t, pool, v); !slices.Equal(hs, truth) {
			t.Errorf("viewer %.8s: snapshot hides %v, the database %v", v, hs, truth)
		}
		heads[v] = at
	}
	return heads
}

// drillReminderStates maps each reminder version of author to its state.
func drillReminderStates(t testing.TB, pool *pgxpool.Pool, author string) map[string]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT id, state FROM buzz.reminders WHERE pubkey = $1`, author)
	if err != nil {
		t.Fatal(err)
	}
	type row struct{ ID, State string }
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, r := range rs {
		out[r.ID] = r.State
	}
	return out
}
