package relay

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// setBased errs only towards false: an event it calls set-based is one buzz.plain_events stores
// set-based too, so calls sized by it (store.Group.Special) keep within 60 subtransactions. It
// need not find every plain event.
func TestSetBasedErrsTowardsSpecial(t *testing.T) {
	pool := testenv.Pool(t, testenv.FreshDB(t))
	u := testenv.NewUser()
	future := strconv.FormatInt(time.Now().Add(time.Hour).Unix(), 10)
	past := strconv.FormatInt(time.Now().Add(-time.Hour).Unix(), 10)
	var evs []*nostr.Event
	for _, k := range []int{0, 1, 3, 5, 7, 1059, 9, 10002, 20001, 30023, 30622, 39999, 40000, 41010, 41011, 41012, 65535} {
		evs = append(evs, u.Event(t, k, nil, "x"))
	}
	for _, tags := range []nostr.Tags{
		{{"h", "c"}}, {{"t", "go"}, {"h", "c"}}, {{"expiration", future}}, {{"expiration", past}}, {{}},
		{{"t", "go"}}, {{"e", u.PK}, {"p", u.PK}},
	} {
		evs = append(evs, u.Event(t, 1, tags, "x"))
	}
	raw, err := json.Marshal(evs)
	if err != nil {
		t.Fatal(err)
	}
	var plain []bool
	if err := pool.QueryRow(context.Background(), `SELECT buzz.plain_events($1::jsonb)`, string(raw)).Scan(&plain); err != nil {
		t.Fatal(err)
	}
	found := 0
	for i, ev := range evs {
		if setBased(ev) {
			found++
			if !plain[i] {
				t.Errorf("kind %d tags %v: setBased, but plain_events stores it alone", ev.Kind, ev.Tags)
			}
		}
	}
	if found < 5 {
		t.Fatalf("setBased found %d set-based events, want the plain kinds without h or expiration tags", found)
	}
}
