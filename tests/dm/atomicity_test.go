package dm

import (
	"context"
	"strings"
	"testing"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/store"
)

// I1: acceptance and its visibility consequence commit together or not at all.
func TestAcceptAndOutboxCommitTogether(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	a, b := newUser(), newUser()
	ch := e.open(a, b)
	e.hide(b, ch)
	e.assertAgree(b, 1)

	// Make the outbox write fail for b only (other tests share the database).
	_, err := e.pool.Exec(ctx, `
		CREATE FUNCTION pg_temp_fail_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'outbox write failed (test)'; END $$;
		CREATE TRIGGER test_fail_outbox BEFORE INSERT OR UPDATE ON buzz.visibility_outbox
		  FOR EACH ROW WHEN (NEW.viewer = '`+b.PK+`') EXECUTE FUNCTION pg_temp_fail_outbox();`)
	if err != nil {
		t.Fatal(err)
	}
	cleanup := func() {
		_, _ = e.pool.Exec(ctx, `DROP TRIGGER IF EXISTS test_fail_outbox ON buzz.visibility_outbox; DROP FUNCTION IF EXISTS pg_temp_fail_outbox()`)
	}
	t.Cleanup(cleanup)

	m := a.Event(t, 9, nostr.Tags{{"h", ch}}, "are you there?")
	ok, msg, err := store.Accept(ctx, e.pool, m)
	if err == nil || ok {
		t.Fatalf("accept must fail when the outbox write fails: ok=%v msg=%q err=%v", ok, msg, err)
	}
	var n int
	_ = e.pool.QueryRow(ctx, `SELECT count(*) FROM buzz.events WHERE id=$1`, m.ID).Scan(&n)
	if n != 0 {
		t.Fatal("I1 broken: the message was stored although its visibility consequence failed")
	}
	if !e.hidden(b, ch) {
		t.Fatal("I1 broken: the hide was cleared although the outbox write failed")
	}
	e.assertAgree(b, 1)

	cleanup()
	ok, msg = e.accept(m)
	if !ok || msg != "" {
		t.Fatalf("resend: %v %q", ok, msg)
	}
	_ = e.pool.QueryRow(ctx, `SELECT count(*) FROM buzz.events WHERE id=$1`, m.ID).Scan(&n)
	if n != 1 || e.hidden(b, ch) {
		t.Fatalf("after resend: stored %d, hidden %v", n, e.hidden(b, ch))
	}
	e.assertAgree(b, 2)
	if ok, msg := e.accept(m); !ok || !strings.HasPrefix(msg, "duplicate:") {
		t.Fatalf("third send: %v %q", ok, msg)
	}
}
