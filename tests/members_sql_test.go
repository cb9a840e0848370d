package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Which member-row changes tell the relays to forget cached member sets (sql/0005_fanout.up.sql), read from a
// test_decoding slot: an operator's insert, move or delete of member rows, and a truncate, do;
// opening a DM (its channel is new, nothing can have cached it) and hiding one do not.
func TestMemberEditsAreAnnounced(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	announced := memberAnnouncements(t, pool)
	expect := func(step string, want ...string) {
		t.Helper()
		if got := announced(); !slices.Equal(got, want) {
			t.Fatalf("%s: announced %q, want %q", step, got, want)
		}
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	alice, bob, carol, dave := newFanUser(), newFanUser(), newFanUser(), newFanUser()
	open := func(with string) string {
		t.Helper()
		ev := alice.event(41010, "", nostr.Tag{"p", with})
		b, _ := json.Marshal(ev)
		var msg string
		if err := pool.QueryRow(ctx, `SELECT message FROM buzz.accept_event($1::jsonb)`, string(b)).Scan(&msg); err != nil {
			t.Fatal(err)
		}
		var resp struct {
			ChannelID string `json:"channel_id"`
		}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(msg, "response:")), &resp); err != nil || resp.ChannelID == "" {
			t.Fatalf("DM open: %q %v", msg, err)
		}
		return resp.ChannelID
	}
	ch := open(bob.pk)
	other := open(carol.pk)
	expect("two DM opens")
	exec(`SELECT buzz.hide_dm($1, $2::uuid)`, bob.pk, ch)
	exec(`SELECT buzz.unhide_dm($1, $2::uuid)`, bob.pk, ch)
	expect("a hide and an unhide")

	exec(`INSERT INTO buzz.members (channel_id, pubkey) VALUES ($1::uuid, $2)`, ch, carol.pk)
	expect("an operator's insert into an existing DM", ch)
	// The channel row rewritten in the same transaction (its xmin is now ours, as for a new one).
	erin := newFanUser()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE buzz.channels SET created_by = created_by WHERE id = $1::uuid`, ch); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO buzz.members (channel_id, pubkey) VALUES ($1::uuid, $2)`, ch, erin.pk)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	expect("an insert beside an update of its channel", ch)
	// An upsert naming every existing member and a new one: only the new row is inserted, the
	// others are rewritten (so they carry this transaction's xmin) by the update branch.
	frank := newFanUser()
	exec(`INSERT INTO buzz.members (channel_id, pubkey)
	      SELECT channel_id, pubkey FROM buzz.members WHERE channel_id = $1::uuid UNION ALL SELECT $1::uuid, $2
	      ON CONFLICT (channel_id, pubkey) DO UPDATE SET hidden_at = NULL`, ch, frank.pk)
	expect("an upsert adding a member beside the existing ones", ch)
	exec(`UPDATE buzz.members SET pubkey = $3 WHERE channel_id = $1::uuid AND pubkey = $2`, ch, carol.pk, dave.pk)
	expect("a key moved", ch)
	exec(`UPDATE buzz.members SET channel_id = $2::uuid WHERE channel_id = $1::uuid AND pubkey = $3`, ch, other, dave.pk)
	want := []string{ch, other}
	slices.Sort(want)
	expect("a row moved to another channel", strings.Join(want, ","))
	exec(`DELETE FROM buzz.members WHERE pubkey = $1`, dave.pk)
	expect("a delete", other)
	exec(`TRUNCATE buzz.members CASCADE`)
	expect("a truncate", "all")
}

// memberAnnouncements opens a test_decoding slot and returns a function that gives the channel
// lists of the 'members' messages committed since its last call ("all" for a truncate), in
// commit order.
func memberAnnouncements(t *testing.T, pool *pgxpool.Pool) func() []string {
	t.Helper()
	ctx := context.Background()
	slot := fmt.Sprintf("members_%d", time.Now().UnixNano()%1e12)
	if _, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) })
	return func() []string {
		t.Helper()
		var out []string
		for _, data := range testenv.MustColumn[string](t, pool, `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, slot) {
			i := strings.Index(data, "content:")
			if !strings.HasPrefix(data, "message:") || !strings.Contains(data, "prefix: buzz,") || i < 0 {
				continue
			}
			var m struct {
				T        string   `json:"t"`
				Channels []string `json:"channels"`
				All      bool     `json:"all"`
			}
			if err := json.Unmarshal([]byte(data[i+len("content:"):]), &m); err != nil {
				t.Fatalf("undecodable buzz message %q: %v", data, err)
			}
			if m.T != "members" {
				continue
			}
			if m.All {
				out = append(out, "all")
				continue
			}
			slices.Sort(m.Channels)
			out = append(out, strings.Join(m.Channels, ","))
		}
		return out
	}
}

// Two sessions insert the first member rows of one empty channel at the same time (0025). Each
// statement alone sees only its own rows; without a lock both would stay quiet, and a relay that
// cached the set between the two commits would keep the first one's members for good. Steps:
// s1 inserts (and holds the channel's lock), s2 inserts and waits, s1 commits (quiet: nothing
// else was there), s2 checks with s1's rows visible and announces, s2 commits. Under REPEATABLE
// READ an insert always announces: its snapshot could not see a concurrent inserter's commit.
func TestConcurrentFirstMemberInsertsAnnounce(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	announced := memberAnnouncements(t, pool)
	newChannel := func() string {
		t.Helper()
		var id string
		if err := pool.QueryRow(ctx, `INSERT INTO buzz.channels (participant_hash, created_by)
		      VALUES (sha256(gen_random_uuid()::text::bytea), $1) RETURNING id::text`, newFanUser().pk).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	session := func() (pgx.Tx, int) {
		t.Helper()
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(conn.Release)
		var pid int
		if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		return tx, pid
	}
	insert := `INSERT INTO buzz.members (channel_id, pubkey) VALUES ($1::uuid, $2)`

	ch := newChannel()
	if got := announced(); len(got) != 0 {
		t.Fatalf("creating a channel announced %q", got)
	}
	s1, _ := session()
	s2, pid2 := session()
	if _, err := s1.Exec(ctx, insert, ch, newFanUser().pk); err != nil {
		t.Fatal(err)
	}
	s2done := make(chan error, 1)
	go func() {
		_, err := s2.Exec(ctx, insert, ch, newFanUser().pk)
		s2done <- err
	}()
	// s2 is either waiting on the channel's lock (the fix) or already through (no lock: it will
	// have stayed quiet, and the check at the end says so).
	testenv.WaitUntil(t, 10*time.Second, "s2 waiting for the channel's lock or done", func() bool {
		if len(s2done) > 0 {
			return true
		}
		var waiting bool
		_ = pool.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_locks WHERE pid = $1 AND locktype = 'advisory' AND NOT granted`, pid2).Scan(&waiting)
		return waiting
	})
	if err := s1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-s2done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("s2's insert still waits after s1 committed")
	}
	if err := s2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if got := announced(); !slices.Equal(got, []string{ch}) {
		t.Fatalf("two concurrent first inserts into %s announced %q; the second must announce it", ch, got)
	}

	rr := newChannel()
	if err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, insert, rr, newFanUser().pk)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if got := announced(); !slices.Equal(got, []string{rr}) {
		t.Fatalf("a first insert under REPEATABLE READ announced %q, want %s", got, rr)
	}
}
