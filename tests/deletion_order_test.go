package tests

import (
	"context"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Two deletions naming the same two events in opposite orders do not deadlock (sql/0015: targets
// are taken sorted). Deletion 1 ([A, B]) is paused inside A's DELETE, holding A's lock; deletion 2
// ([B, A]) then runs until it waits for A. In tag order it would hold B by then, and deletion 1,
// released, would wait for B: a cycle that PostgreSQL breaks after deadlock_timeout with 40P01 for
// one of them. Sorted, deletion 2 holds nothing while it waits for A, and both commit.
func TestDeletionsTakeTargetsInOneOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	author := newFanUser()
	a, b := author.event(1, "a"), author.event(1, "b")
	if a.ID > b.ID {
		a, b = b, a
	}
	for _, ev := range []*nostr.Event{a, b} {
		fanPsqlAccept(t, url, ev)
	}
	// The pause: a DELETE of A by deletion 1's session waits for an advisory lock the test holds.
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.pause_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF current_setting('application_name') = 'buzzpg-test-deletion-1' THEN
		    PERFORM pg_advisory_lock(4242);
		    PERFORM pg_advisory_unlock(4242);
		  END IF;
		  RETURN OLD;
		END $$;
		CREATE TRIGGER pause_delete BEFORE DELETE ON buzz.events
		  FOR EACH ROW WHEN (OLD.id = '`+a.ID+`') EXECUTE FUNCTION public.pause_delete();`); err != nil {
		t.Fatal(err)
	}
	holder := testenv.NewSession(t, url, "pause-holder")
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_lock(4242)`); err != nil {
		t.Fatal(err)
	}

	deletion := func(first, second *nostr.Event) *nostr.Event {
		return author.event(5, "", nostr.Tag{"e", first.ID}, nostr.Tag{"e", second.ID})
	}
	d1, d2 := testenv.NewSession(t, url, "deletion-1"), testenv.NewSession(t, url, "deletion-2")
	var err1, err2 error
	d1.Begin()
	done1 := testenv.Async(func() { _, _, err1 = d1.Accept(deletion(a, b)) })
	if !testenv.WaitBlockedOrDone(t, pool, d1.PID, done1) {
		t.Fatalf("deletion 1 did not pause in A's DELETE: %v", err1)
	}
	d2.Begin()
	done2 := testenv.Async(func() { _, _, err2 = d2.Accept(deletion(b, a)) })
	if !testenv.WaitBlockedOrDone(t, pool, d2.PID, done2) {
		t.Fatalf("deletion 2 did not wait for deletion 1: %v", err2)
	}
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_unlock(4242)`); err != nil {
		t.Fatal(err)
	}
	<-done1
	if err1 == nil {
		d1.Commit()
	}
	<-done2
	if err1 != nil || err2 != nil {
		t.Fatalf("deletion 1: %v; deletion 2: %v (want both through, no deadlock)", err1, err2)
	}
	d2.Commit()
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM buzz.events WHERE id = ANY($1)`, []string{a.ID, b.ID}).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d of the two events left (%v)", left, err)
	}
}
