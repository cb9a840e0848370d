package tests

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// docs/protocol.md, NIP-ER, errors, through buzz.accept_event. Each rejected version changes nothing:
// no stored event, no reminder row, and the armed older version of the same address stays armed.
func TestReminderValidationMatrix(t *testing.T) {
	pool := testenv.Pool(t, testenv.DB(t))
	ctx := context.Background()
	sk, _ := testenv.NewKey()
	now := time.Now().Unix()
	var horizon int64
	if err := pool.QueryRow(ctx, `SELECT buzz.cfg('reminder_horizon_seconds')::bigint`).Scan(&horizon); err != nil {
		t.Fatal(err)
	}
	base := remEvent(t, sk, now-10, "m", remNB(now+600))
	remMustAccept(t, pool, base)

	const malformed = "invalid: malformed not_before"
	nb := func(v string) nostr.Tag { return nostr.Tag{"not_before", v} }
	exp := func(v int64) nostr.Tag { return nostr.Tag{"expiration", fmt.Sprint(v)} }
	cases := []struct {
		name string
		d    string
		tags []nostr.Tag
		want string
	}{
		{"negative", "m", []nostr.Tag{nb("-5")}, malformed},
		{"plus sign", "m", []nostr.Tag{nb(fmt.Sprint("+", now+60))}, malformed},
		{"leading zero", "m", []nostr.Tag{nb(fmt.Sprint("0", now+60))}, malformed},
		{"double zero", "m", []nostr.Tag{nb("00")}, malformed},
		{"above 2^53-1", "m", []nostr.Tag{nb("9007199254740992")}, malformed},
		{"17 digits", "m", []nostr.Tag{nb("10000000000000000")}, malformed},
		{"empty", "m", []nostr.Tag{nb("")}, malformed},
		{"not a number", "m", []nostr.Tag{nb("soon")}, malformed},
		{"fraction", "m", []nostr.Tag{nb(fmt.Sprint(now+60, ".5"))}, malformed},
		{"space", "m", []nostr.Tag{nb(fmt.Sprint(" ", now+60))}, malformed},
		{"two not_before", "m", []nostr.Tag{nb(fmt.Sprint(now + 60)), nb(fmt.Sprint(now + 60))}, malformed},
		{"expiration before", "m", []nostr.Tag{nb(fmt.Sprint(now + 7200)), exp(now + 3600)}, "invalid: expiration before not_before"},
		{"expiration equal", "m", []nostr.Tag{nb(fmt.Sprint(now + 7200)), exp(now + 7200)}, "invalid: expiration before not_before"},
		{"too far", "m", []nostr.Tag{nb(fmt.Sprint(now + horizon + 120))}, "invalid: not_before too far in future"},
		{"2^53-1 is well-formed but too far", "m", []nostr.Tag{nb("9007199254740991")}, "invalid: not_before too far in future"},
		{"missing d", "", []nostr.Tag{nb(fmt.Sprint(now + 60))}, "invalid: missing d tag"},
		{"empty d", "", []nostr.Tag{{"d", ""}, nb(fmt.Sprint(now + 60))}, "invalid: missing d tag"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ev := remEvent(t, sk, now, c.d, c.tags...)
			ok, msg, err := remAccept(ctx, pool, ev)
			if err == nil {
				t.Fatalf("accepted (ok=%v %q), want %q", ok, msg, c.want)
			}
			if code := db.SQLState(err); code != "BZ400" || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %s %v, want BZ400 %q", code, err, c.want)
			}
			var events, rems int
			testenv.MustScan(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM buzz.events WHERE id = $1), (SELECT count(*) FROM buzz.reminders WHERE id = $1)`, ev.ID), &events, &rems)
			if events != 0 || rems != 0 {
				t.Fatalf("rejected version left %d events and %d reminder rows", events, rems)
			}
			if r := remGet(t, pool, base.ID); r.State != "armed" {
				t.Fatalf("rejected newer version touched the armed one: %+v", r)
			}
		})
	}

	// The boundary values that are valid: "0" (due at once) and a not_before at the horizon.
	for _, v := range []string{"0", fmt.Sprint(now + horizon - 60)} {
		ev := remEvent(t, sk, now+1, "edge"+v, nb(v))
		remMustAccept(t, pool, ev)
		if r := remGet(t, pool, ev.ID); r.State != "armed" {
			t.Fatalf("not_before %s: %+v, want armed", v, r)
		}
	}
}
