package tests

import (
	"context"
	"hash/crc32"
	"strconv"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Lock order of NIP-09 deletions (sql/0002_accept.up.sql): each test pauses one transaction inside a DELETE
// with a trigger, lets the other run until it waits, releases the first, and checks that no
// deadlock (40P01) broke the two apart.

// pauseRows makes a row trigger on table ("BEFORE DELETE", "AFTER INSERT" ... as timing says),
// for the rows cond holds for (a WHEN condition; "true" for all), wait until release is called
// when the session named session runs the statement. The trigger waits on an advisory lock a
// holder session keeps; name names the trigger and its function, and each pause of one test
// takes a name of its own (and so a lock of its own).
func pauseRows(t *testing.T, url, name, timing, table, cond, session string) (release func()) {
	t.Helper()
	ctx := context.Background()
	key := int64(4200 + crc32.ChecksumIEEE([]byte(name))%1000)
	if _, err := testenv.Pool(t, url).Exec(ctx, `
		CREATE FUNCTION public.`+name+`() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
		  IF current_setting('application_name') = 'buzzpg-test-`+session+`' THEN
		    PERFORM pg_advisory_lock(`+strconv.FormatInt(key, 10)+`);
		    PERFORM pg_advisory_unlock(`+strconv.FormatInt(key, 10)+`);
		  END IF;
		  IF TG_OP = 'DELETE' THEN RETURN OLD; END IF;
		  RETURN NEW;
		END $$;
		CREATE TRIGGER `+name+` `+timing+` ON `+table+`
		  FOR EACH ROW WHEN (`+cond+`) EXECUTE FUNCTION public.`+name+`();`); err != nil {
		t.Fatal(err)
	}
	holder := testenv.NewSession(t, url, name+"-holder")
	if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, key); err != nil {
		t.Fatal(err)
	}
	released := false
	return func() {
		if !released {
			released = true
			if _, err := holder.Conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, key); err != nil {
				t.Error(err)
			}
		}
	}
}

// pauseDeleteOf makes a DELETE of event id, run by the session named session, wait (in a row
// trigger, BEFORE or AFTER as when says) until release is called.
func pauseDeleteOf(t *testing.T, url, id, when, session string) (release func()) {
	t.Helper()
	return pauseRows(t, url, "pause_delete", when+" DELETE", "buzz.events", "OLD.id = '"+id+"'", session)
}

// pausedThenWaiting accepts first in a session named firstName until it is paused (pauseDeleteOf),
// then second in another until it waits, releases the pause, and returns both outcomes, committing
// each that went through.
func pausedThenWaiting(t *testing.T, url, firstName string, first *nostr.Event, secondName string, second *nostr.Event, release func()) (err1, err2 error) {
	t.Helper()
	pool := testenv.Pool(t, url)
	s1, s2 := testenv.NewSession(t, url, firstName), testenv.NewSession(t, url, secondName)
	s1.Begin()
	done1 := testenv.Async(func() { _, _, err1 = s1.Accept(first) })
	if !testenv.WaitBlockedOrDone(t, pool, s1.PID, done1) {
		t.Fatalf("%s did not pause: %v", firstName, err1)
	}
	s2.Begin()
	done2 := testenv.Async(func() { _, _, err2 = s2.Accept(second) })
	if !testenv.WaitBlockedOrDone(t, pool, s2.PID, done2) {
		t.Fatalf("%s did not wait for %s: %v", secondName, firstName, err2)
	}
	release()
	<-done1
	if err1 == nil {
		s1.Commit()
	}
	<-done2
	if err2 == nil {
		s2.Commit()
	}
	return err1, err2
}

// Two deletions naming the same two events in opposite orders. Deletion 1 ([A, B]) pauses inside
// A's DELETE, holding A's lock; deletion 2 ([B, A]) runs until it waits for A. In tag order it
// would hold B by then, and deletion 1, released, would wait for B. Sorted, deletion 2 holds
// nothing while it waits for A.
func TestDeletionsTakeTargetsInOneOrder(t *testing.T) {
	url := testenv.FreshDB(t)
	author := newFanUser()
	a, b := author.event(1, "a"), author.event(1, "b")
	if a.ID > b.ID {
		a, b = b, a
	}
	for _, ev := range []*nostr.Event{a, b} {
		fanPsqlAccept(t, url, ev)
	}
	deletion := func(first, second *nostr.Event) *nostr.Event {
		return author.event(5, "", nostr.Tag{"e", first.ID}, nostr.Tag{"e", second.ID})
	}
	release := pauseDeleteOf(t, url, a.ID, "BEFORE", "deletion-1")
	err1, err2 := pausedThenWaiting(t, url, "deletion-1", deletion(a, b), "deletion-2", deletion(b, a), release)
	if err1 != nil || err2 != nil {
		t.Fatalf("deletion 1: %v; deletion 2: %v (want both through, no deadlock)", err1, err2)
	}
	var left int
	if err := testenv.Pool(t, url).QueryRow(context.Background(), `SELECT count(*) FROM buzz.events WHERE id = ANY($1)`, []string{a.ID, b.ID}).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d of the two events left (%v)", left, err)
	}
}

// A deletion naming a version both by id (e) and by its address (a), beside the acceptance of a
// newer version of that address (addresses first, as acceptance takes them). The deletion pauses
// just after it deleted the old version X (its row lock held); the acceptance of Y then runs
// until it waits. In the old order (ids first) the deletion held X's row without the address
// lock, the acceptance took the address lock and waited for X's row, and the deletion, released,
// waited for the address lock.
func TestDeletionByIDAndAddressBesideANewVersion(t *testing.T) {
	url := testenv.FreshDB(t)
	author := newFanUser()
	now := nostr.Now()
	x := author.eventAt(t, 30023, now-20, nostr.Tag{"d", "post"})
	fanPsqlAccept(t, url, x)
	deletion := author.eventAt(t, 5, now-10, nostr.Tag{"e", x.ID}, nostr.Tag{"a", "30023:" + author.pk + ":post"})
	y := author.eventAt(t, 30023, now, nostr.Tag{"d", "post"})

	release := pauseDeleteOf(t, url, x.ID, "AFTER", "deletion")
	if errDel, errAcc := pausedThenWaiting(t, url, "deletion", deletion, "acceptance", y, release); errDel != nil || errAcc != nil {
		t.Fatalf("deletion: %v; acceptance of Y: %v (want both through, no deadlock)", errDel, errAcc)
	}
	var ids []string
	if err := testenv.Pool(t, url).QueryRow(context.Background(), `SELECT coalesce(array_agg(id), '{}') FROM buzz.events WHERE kind = 30023 AND pubkey = $1`, author.pk).Scan(&ids); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 1 || ids[0] != y.ID {
		t.Fatalf("versions stored %v, want only Y %s (newer than the deletion)", ids, y.ID)
	}
}

// A deletion by address of a replaceable kind serialises with an acceptance of that kind, whatever
// the a tag's third part says (replaceable kinds have none; accept_event locks kind:pubkey:”). A
// version no newer than the deletion, accepted while the deletion is uncommitted, waits for it
// and is then refused, instead of slipping past its unseen tombstone.
func TestDeletionOfAReplaceableKindSerialisesWithAcceptance(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	author := newFanUser()
	now := nostr.Now()
	deletion := author.eventAt(t, 5, now, nostr.Tag{"a", "10002:" + author.pk + ":x"})
	late := author.eventAt(t, 10002, now-5) // no newer than the deletion: covered by it
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

// A deletion naming a version X both by id and by address, beside the acceptance of X itself.
// A third session holds X's address lock; the deletion starts first and waits, then the
// acceptance (which takes event:X, then the address lock) waits too. When the address lock goes,
// a deletion that waited for the address first would hold it and wait for event:X, held by the
// acceptance waiting for the address: a cycle. Taking ids first, the deletion holds event:X and
// the acceptance waits behind it, then finds X deleted.
func TestDeletionTakesIDsBeforeAddressesAsAcceptanceDoes(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	author := newFanUser()
	now := nostr.Now()
	x := author.eventAt(t, 30023, now-10, nostr.Tag{"d", "post"})
	deletion := author.eventAt(t, 5, now, nostr.Tag{"a", "30023:" + author.pk + ":post"}, nostr.Tag{"e", x.ID})

	holder := testenv.NewSession(t, url, "address-holder")
	holder.Begin()
	if _, err := holder.Tx.Exec(context.Background(), `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`,
		"30023:"+author.pk+":post"); err != nil {
		t.Fatal(err)
	}
	del, acc := testenv.NewSession(t, url, "deletion"), testenv.NewSession(t, url, "acceptance")
	var errDel, errAcc error
	var okAcc bool
	var msgAcc string
	del.Begin()
	doneDel := testenv.Async(func() { _, _, errDel = del.Accept(deletion) })
	if !testenv.WaitBlockedOrDone(t, pool, del.PID, doneDel) {
		t.Fatalf("the deletion did not wait for the held address: %v", errDel)
	}
	acc.Begin()
	doneAcc := testenv.Async(func() { okAcc, msgAcc, errAcc = acc.Accept(x) })
	if !testenv.WaitBlockedOrDone(t, pool, acc.PID, doneAcc) {
		t.Fatalf("the acceptance did not wait: ok=%v %q %v", okAcc, msgAcc, errAcc)
	}
	holder.Commit()
	<-doneDel
	if errDel != nil {
		t.Fatalf("deletion: %v (want through, no deadlock)", errDel)
	}
	del.Commit()
	<-doneAcc
	if errAcc != nil || okAcc || msgAcc != "blocked: deleted" {
		t.Fatalf("acceptance of X after its deletion: ok=%v %q %v, want blocked: deleted", okAcc, msgAcc, errAcc)
	}
	acc.Commit()
}
