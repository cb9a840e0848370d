package tests

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A process does not take WebSocket clients before its replication slot exists. Creating a
// logical slot waits for every transaction open at that moment; a subscriber served in that
// window would miss, for good, the events committed before the slot's starting point. Here a
// transaction holding an xid keeps the slot from being created: the relay answers /healthz but
// refuses the WebSocket upgrade with 503; once the transaction ends it serves clients.
//
// On a private cluster: the blocker holds back slot creation cluster-wide, and other test
// packages running at the same time create slots too.
func TestNoClientsBeforeTheSlotExists(t *testing.T) {
	dbURL := testenv.PrivateCluster(t, "slot-gate").MigratedURL(t)
	pool := testenv.Pool(t, dbURL)
	ctx := context.Background()
	blocker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = blocker.Rollback(ctx) }()
	if _, err := blocker.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	key, _ := testenv.NewKey()
	inst := fmt.Sprintf("slotgate%d", time.Now().UnixNano()%1e9)
	type started struct {
		p   *bench.Proc
		err error
	}
	startc := make(chan started, 1)
	// Binary and TempDir may fail the test: resolved here, on the test's goroutine.
	opts := bench.ProcOpts{
		Bin: testenv.Binary(t), DatabaseURL: dbURL, RelayKey: key, InstanceID: inst, Listen: addr,
		LogPath: filepath.Join(t.TempDir(), "serve.log"),
	}
	go func() {
		p, err := bench.StartServe(opts, 60*time.Second)
		startc <- started{p, err}
	}()
	var st started
	got := false
	t.Cleanup(func() {
		if !got { // failed before the start returned: end the blocker, then wait for it
			_ = blocker.Rollback(ctx)
			st = <-startc
		}
		if st.p != nil {
			st.p.Kill()
		}
	})

	testenv.WaitUntil(t, 30*time.Second, "/healthz answers", func() bool {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	// The blocker is still open, so the slot cannot exist yet, whatever the timing.
	if c, resp, err := websocket.DefaultDialer.Dial("ws://"+addr, nil); err == nil {
		c.Close()
		t.Fatal("a WebSocket client was served before the replication slot existed")
	} else if resp == nil || resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("before the slot: dial error %v, response %+v; want 503 with Retry-After", err, resp)
	}

	if err := blocker.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	st, got = <-startc, true
	if st.err != nil {
		t.Fatal(st.err)
	}
	c := testenv.Dial(t, st.p.URL)
	c.MustPublish(testenv.NewUser().Event(t, 1, nil, "served after the slot"))
}
