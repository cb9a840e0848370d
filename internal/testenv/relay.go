package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"

	"github.com/buzzpg/buzzpg/internal/bench"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// Binary returns the path of a buzzpg binary built with test hooks (BUZZ_BIN overrides; the
// Makefile builds one once for all packages).
func Binary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if b := os.Getenv("BUZZ_BIN"); b != "" {
			binPath = b
			return
		}
		dir, err := os.MkdirTemp("", "buzzpg-bin")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "buzzpg")
		cmd := exec.Command("go", "build", "-tags", BuildTags(), "-o", binPath, "./cmd/buzzpg")
		cmd.Dir = RepoRoot()
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// BuildTags are the tags test binaries of buzzpg are built with.
func BuildTags() string {
	if t := os.Getenv("BUZZ_BUILD_TAGS"); t != "" {
		return t
	}
	return "testhooks"
}

// NewKey returns a fresh secret key and its pubkey (hex).
func NewKey() (sk, pk string) {
	sk = nostr.GeneratePrivateKey()
	pk, _ = nostr.GetPublicKey(sk)
	return sk, pk
}

// RelayOpts configures a `buzzpg serve` process.
type RelayOpts struct {
	// DatabaseURL is the database; a relay on a migrated one runs as RelayLogin (see relayURL).
	DatabaseURL string
	AsOwner     bool   // run as DatabaseURL's own role even when the schema is current
	RelayKey    string // hex secret key; shared by all processes of a deployment
	InstanceID  string // default: random
	Env         map[string]string
	HookDir     string   // for cross-process hooks (BUZZ_HOOK_DIR)
	Hooks       []string // hook names to arm (BUZZ_HOOKS)
}

// Relay is a running `buzzpg serve` process, started by the same launcher `buzzpg bench` and the
// chaos soak use (internal/bench), with the test's cleanup and log dump around it.
type Relay struct {
	*bench.Proc
	InstanceID string
	LogPath    string
}

// StartRelay starts `buzzpg serve` on a free loopback port and waits until /readyz answers 200.
func StartRelay(t testing.TB, o RelayOpts) *Relay {
	t.Helper()
	return StartRelays(t, o)[0]
}

// StartRelays starts one `buzzpg serve` per opts at the same time and waits until each answers
// /readyz. Everything that can fail the test runs on the caller's goroutine: the starts run in
// goroutines that only return errors, and the test fails (after every started process has its
// cleanup) when any start failed.
func StartRelays(t testing.TB, opts ...RelayOpts) []*Relay {
	t.Helper()
	bin := Binary(t)
	pos := make([]bench.ProcOpts, len(opts))
	for i, o := range opts {
		if o.DatabaseURL == "" {
			o.DatabaseURL = DB(t)
		}
		o.DatabaseURL = relayURL(t, o.DatabaseURL, o.AsOwner)
		if o.RelayKey == "" {
			o.RelayKey, _ = NewKey()
		}
		if o.InstanceID == "" {
			o.InstanceID = fmt.Sprintf("t%d", time.Now().UnixNano()%1e12)
			if len(opts) > 1 {
				o.InstanceID += fmt.Sprintf("i%d", i)
			}
		}
		var env []string
		if o.HookDir != "" {
			env = append(env, "BUZZ_HOOK_DIR="+o.HookDir, "BUZZ_HOOKS="+strings.Join(o.Hooks, ","))
		}
		for k, v := range o.Env {
			env = append(env, k+"="+v)
		}
		pos[i] = bench.ProcOpts{
			Bin: bin, DatabaseURL: o.DatabaseURL, RelayKey: o.RelayKey, InstanceID: o.InstanceID,
			Env: env, LogPath: filepath.Join(t.TempDir(), "buzzpg-"+o.InstanceID+".log"), LogLevel: "debug",
		}
	}
	procs := make([]*bench.Proc, len(opts))
	errs := make([]error, len(opts))
	var wg sync.WaitGroup
	for i := range pos {
		wg.Add(1)
		go func() {
			defer wg.Done()
			procs[i], errs[i] = bench.StartServe(pos[i], 60*time.Second)
		}()
	}
	wg.Wait()
	relays := make([]*Relay, len(opts))
	for i, p := range procs {
		if p == nil {
			continue
		}
		r := &Relay{Proc: p, InstanceID: pos[i].InstanceID, LogPath: pos[i].LogPath}
		relays[i] = r
		t.Cleanup(func() {
			r.Stop()
			if t.Failed() {
				b, _ := os.ReadFile(r.LogPath)
				if len(b) > 20000 {
					b = b[len(b)-20000:]
				}
				t.Logf("buzzpg %s log (tail):\n%s", r.InstanceID, b)
			}
		})
	}
	failed := false
	for i, err := range errs {
		if err != nil {
			b, _ := os.ReadFile(pos[i].LogPath)
			t.Errorf("start relay %d (%s): %v\n%s", i, pos[i].InstanceID, err, b)
			failed = true
		}
	}
	if failed {
		t.FailNow()
	}
	return relays
}

// Stop sends SIGTERM (graceful shutdown) and waits up to 30s, then kills.
func (r *Relay) Stop() { r.Proc.Stop(30 * time.Second) }

// ExitCode is the process's exit code once it has ended (-1 for a signal).
func (r *Relay) ExitCode() int {
	<-r.Done()
	var ee *exec.ExitError
	if errors.As(r.ExitErr(), &ee) {
		return ee.ExitCode()
	}
	return 0
}

// Log returns what the process logged so far.
func (r *Relay) Log() string { b, _ := os.ReadFile(r.LogPath); return string(b) }

// Connect opens a go-nostr client connection to the relay.
func (r *Relay) Connect(t testing.TB) *nostr.Relay {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := nostr.RelayConnect(ctx, r.URL)
	if err != nil {
		t.Fatalf("connect %s: %v", r.URL, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}
