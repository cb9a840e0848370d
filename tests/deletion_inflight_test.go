package tests

import (
	"context"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Event locks of a deletion taken as one sorted set with its own id (sql/0002_accept.up.sql). Each test pauses
// one acceptance as it inserts its event row, lets the other run until it waits, releases the
// first, and checks that no deadlock (40P01) broke the two apart.

// pauseInsertOf makes the INSERT of event id into buzz.events, run by the session named session,
// wait (in a BEFORE row trigger) until release is called. Like pauseDeleteOf, for the insert.
func pauseInsertOf(t *testing.T, url, id, session string) (release func()) {
	t.Helper()
	return pauseRows(t, url, "pause_insert", "BEFORE INSERT", "buzz.events", "NEW.id = '"+id+"'", session)
}

// deletionSortedAfter signs deletions by author naming the given events (plus a nonce tag) until
// one's id sorts after after.ID.
func deletionSortedAfter(author fanUser, after *nostr.Event, named ...*nostr.Event) *nostr.Event {
	var tags []nostr.Tag
	for _, ev := range named {
		tags = append(tags, nostr.Tag{"e", ev.ID})
	}
	for {
		if d := author.event(5, "", tags...); d.ID > after.ID {
			return d
		}
	}
}

// tombstoneBy returns who deleted id (deleted_ids.deleted_by for the author), "" when nobody did.
func tombstoneBy(t *testing.T, url, id, author string) string {
	t.Helper()
	var by string
	_ = testenv.Pool(t, url).QueryRow(context.Background(),
		`SELECT deleted_by FROM buzz.deleted_ids WHERE id = $1 AND pubkey = $2`, id, author).Scan(&by)
	return by
}

// storedIDs returns which of ids are stored.
func storedIDs(t *testing.T, url string, ids ...string) map[string]bool {
	t.Helper()
	rows, err := testenv.Pool(t, url).Query(context.Background(), `SELECT id FROM buzz.events WHERE id = ANY($1)`, ids)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		got[id] = true
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}

// Deletion D1 names X; deletion D2 names D1 and X; X sorts before D1. D1 pauses as it inserts its
// row. Locking its own id first (0009), it held only event:D1 then; D2 took event:D2 and event:X
// and waited for event:D1, and D1, released, waited for event:X: a cycle PostgreSQL broke with
// 40P01 after deadlock_timeout. With its own id in the sorted set, D1 already holds event:X and
// event:D1, and D2 waits holding nothing D1 needs.
func TestDeletionNamingAnInFlightDeletion(t *testing.T) {
	url := testenv.FreshDB(t)
	author := newFanUser()
	x := author.event(1, "x")
	fanPsqlAccept(t, url, x)
	d1 := deletionSortedAfter(author, x, x)
	d2 := author.event(5, "", nostr.Tag{"e", d1.ID}, nostr.Tag{"e", x.ID})

	release := pauseInsertOf(t, url, d1.ID, "deletion-1")
	err1, err2 := pausedThenWaiting(t, url, "deletion-1", d1, "deletion-2", d2, release)
	if err1 != nil || err2 != nil {
		t.Fatalf("deletion 1: %v; deletion 2: %v (want both through, no deadlock)", err1, err2)
	}
	stored := storedIDs(t, url, x.ID, d1.ID, d2.ID)
	if stored[x.ID] || !stored[d1.ID] || !stored[d2.ID] {
		t.Fatalf("stored %v: want X deleted, both deletions stored (a deletion is never deleted)", stored)
	}
	if by := tombstoneBy(t, url, x.ID, author.pk); by != d1.ID {
		t.Fatalf("X's tombstone by %q, want deletion 1 %s (it committed first)", by, d1.ID)
	}
	if by := tombstoneBy(t, url, d1.ID, author.pk); by != d2.ID {
		t.Fatalf("deletion 1's tombstone by %q, want deletion 2 %s", by, d2.ID)
	}
}

// A deletion D whose own id sorts after its target X, beside the plain acceptance of X (which
// holds event:X only). Either side pausing first, the other waits holding nothing the first
// needs: no deadlock either way.
func TestDeletionSortedAfterItsTargetBesideTheTargetsAcceptance(t *testing.T) {
	for _, deletionFirst := range []bool{false, true} {
		// Acceptance first: X pauses at its insert holding event:X; D waits for event:X, then
		// deletes X. Deletion first: D pauses at its insert holding event:X and event:D; X waits
		// for event:X, then finds its tombstone. (Under 0009 D held only event:D there, and X was
		// stored at once and deleted when D went on: no deadlock either, but no wait, so this
		// half fails there.)
		name := map[bool]string{false: "acceptance first", true: "deletion first"}[deletionFirst]
		t.Run(name, func(t *testing.T) {
			url := testenv.FreshDB(t)
			author := newFanUser()
			x := author.event(1, "x")
			d := deletionSortedAfter(author, x, x)
			firstName, first, secondName, second := "acceptance", x, "deletion", d
			if deletionFirst {
				firstName, first, secondName, second = secondName, second, firstName, first
			}
			release := pauseInsertOf(t, url, first.ID, firstName)
			if err1, err2 := pausedThenWaiting(t, url, firstName, first, secondName, second, release); err1 != nil || err2 != nil {
				t.Fatalf("%s: %v; %s: %v (want both through, no deadlock)", firstName, err1, secondName, err2)
			}
			if stored := storedIDs(t, url, x.ID, d.ID); stored[x.ID] || !stored[d.ID] {
				t.Fatalf("stored %v: want X deleted (or refused) and the deletion stored", stored)
			}
			if by := tombstoneBy(t, url, x.ID, author.pk); by != d.ID {
				t.Fatalf("X's tombstone by %q, want %s", by, d.ID)
			}
		})
	}
}
