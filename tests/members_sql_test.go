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
	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Which member-row changes tell the relays to forget cached member sets (sql/0014), read from a
// test_decoding slot: an operator's insert, move or delete of member rows, and a truncate, do;
// opening a DM (its channel is new, nothing can have cached it) and hiding one do not.
func TestMemberEditsAreAnnounced(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	slot := fmt.Sprintf("members_%d", time.Now().UnixNano()%1e12)
	if _, err := pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, slot); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, slot) })
	// announced returns the channel lists of the 'members' messages committed since the last call
	// ("all" for a truncate).
	announced := func() []string {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT data FROM pg_logical_slot_get_changes($1, NULL, NULL)`, slot)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var data string
			if err := rows.Scan(&data); err != nil {
				t.Fatal(err)
			}
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
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
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
