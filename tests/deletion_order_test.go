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

// A deletion naming a version both by id (e) and by its address (a), beside the acceptance of a
// newer version of that address, does not deadlock (sql/0015: addresses first, as acceptance
// takes them). The deletion is paused just after it deleted the old version X (its row lock
// held); the acceptance of Y then runs until it waits. In the old order (ids first) the deletion
// held X's row without the address lock, the acceptance took the address lock and waited for X's
// row, and the deletion, released, waited for the address lock: 40P01 after deadlock_timeout.
func TestDeletionByIDAndAddressBesideANewVersion(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	ctx := context.Background()
	author := newFanUser()
	now := nostr.Now()
	sign := func(kind int, at nostr.Timestamp, tags ...nostr.Tag) *nostr.Event {
		ev := &nostr.Event{Kind: kind, CreatedAt: at, Tags: tags, Content: "v"}
		if err := ev.Sign(author.sk); err != nil {
			t.Fatal(err)
		}
		return ev
	}
	x := sign(30023, now-20, nostr.Tag{"d", "post"})
	fanPsqlAccept(t, url, x)
	deletion := sign(5, now-10, nostr.Tag{"e", x.ID}, nostr.Tag{"a", "30023:" + author.pk + ":post"})
	y := sign(30023, now, nostr.Tag{"d", "post"})

	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.pause_after_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF current_setting('application_name') = 'buzzpg-test-deletion' THEN
		    PERFORM pg_advisory_lock(4243);
		    PERFORM pg_advisory_unlock(4243);
		  END IF;
		  RETURN NULL;
		END $$;
		CREATE TRIGGER pause_after_delete AFTER DELETE ON buzz.events
		  FOR EACH ROW WHEN (OLD.id = '`+x.ID+`') EXECUTE FUNCTION public.pause_after_delete();`); err != nil {
		t.Fatal(err)
	}
	holder := testenv.NewSession(t, url, "pause-holder")
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_lock(4243)`); err != nil {
		t.Fatal(err)
	}
	del, acc := testenv.NewSession(t, url, "deletion"), testenv.NewSession(t, url, "acceptance")
	var errDel, errAcc error
	del.Begin()
	doneDel := testenv.Async(func() { _, _, errDel = del.Accept(deletion) })
	if !testenv.WaitBlockedOrDone(t, pool, del.PID, doneDel) {
		t.Fatalf("the deletion did not pause after deleting X: %v", errDel)
	}
	acc.Begin()
	doneAcc := testenv.Async(func() { _, _, errAcc = acc.Accept(y) })
	if !testenv.WaitBlockedOrDone(t, pool, acc.PID, doneAcc) {
		t.Fatalf("the acceptance of Y did not wait for the deletion: %v", errAcc)
	}
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_unlock(4243)`); err != nil {
		t.Fatal(err)
	}
	<-doneDel
	if errDel == nil {
		del.Commit()
	}
	<-doneAcc
	if errDel != nil || errAcc != nil {
		t.Fatalf("deletion: %v; acceptance of Y: %v (want both through, no deadlock)", errDel, errAcc)
	}
	acc.Commit()
	var ids []string
	if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(id), '{}') FROM buzz.events WHERE kind = 30023 AND pubkey = $1`, author.pk).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 || ids[0] != y.ID {
		t.Fatalf("versions stored %v, want only Y %s (newer than the deletion)", ids, y.ID)
	}
}

// A deletion by address of a replaceable kind serialises with an acceptance of that kind, whatever
// the a tag's third part says (replaceable kinds have none; accept_event locks kind:pubkey:''). A
// version no newer than the deletion, accepted while the deletion is uncommitted, waits for it
// and is then refused, instead of slipping past its unseen tombstone.
func TestDeletionOfAReplaceableKindSerialisesWithAcceptance(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	author := newFanUser()
	now := nostr.Now()
	sign := func(kind int, at nostr.Timestamp, tags ...nostr.Tag) *nostr.Event {
		ev := &nostr.Event{Kind: kind, CreatedAt: at, Tags: tags, Content: "v"}
		if err := ev.Sign(author.sk); err != nil {
			t.Fatal(err)
		}
		return ev
	}
	deletion := sign(5, now, nostr.Tag{"a", "10002:" + author.pk + ":x"})
	late := sign(10002, now-5) // no newer than the deletion: covered by it
	del, acc := testenv.NewSession(t, url, "deletion"), testenv.NewSession(t, url, "acceptance")
	del.Begin()
	del.MustAccept(deletion)
	acc.Begin()
	var ok bool
	var msg string
	var err error
	done := testenv.Async(func() { ok, msg, err = acc.Accept(late) })
	if !testenv.WaitBlockedOrDone(t, pool, acc.PID, done) {
		t.Fatalf("the acceptance did not wait for the uncommitted deletion: ok=%v %q %v", ok, msg, err)
	}
	del.Commit()
	<-done
	if err != nil || ok || msg != "blocked: deleted" {
		t.Fatalf("a version covered by the deletion: ok=%v %q %v, want blocked: deleted", ok, msg, err)
	}
	acc.Commit()
}
