package testenv

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nbd-wtf/go-nostr"
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
	DatabaseURL string
	RelayKey    string // hex secret key; shared by all processes of a deployment
	InstanceID  string // default: random
	Env         map[string]string
	Args        []string // extra serve flags
	HookDir     string   // for cross-process hooks (BUZZ_HOOK_DIR)
	Hooks       []string // hook names to arm (BUZZ_HOOKS)
	NoWaitReady bool     // return once listening, before /readyz is 200
}

// Relay is a running `buzzpg serve` process.
type Relay struct {
	URL        string // ws://127.0.0.1:port
	HTTPURL    string // http://127.0.0.1:port
	InstanceID string
	Cmd        *exec.Cmd
	LogPath    string
	done       chan struct{}
	exitErr    error
	t          testing.TB
}

// StartRelay starts `buzzpg serve` on a free loopback port and waits until it is ready.
func StartRelay(t testing.TB, o RelayOpts) *Relay {
	t.Helper()
	if o.DatabaseURL == "" {
		o.DatabaseURL = DB(t)
	}
	if o.RelayKey == "" {
		o.RelayKey, _ = NewKey()
	}
	if o.InstanceID == "" {
		o.InstanceID = fmt.Sprintf("t%d", time.Now().UnixNano()%1e12)
	}
	logPath := filepath.Join(t.TempDir(), "buzzpg-"+o.InstanceID+".log")
	args := append([]string{"serve"}, o.Args...)
	cmd := exec.Command(Binary(t), args...)
	env := append(os.Environ(),
		"DATABASE_URL="+o.DatabaseURL,
		"BUZZ_LISTEN=127.0.0.1:0",
		"BUZZ_RELAY_KEY="+o.RelayKey,
		"BUZZ_RELAY_KEY_FILE=",
		"BUZZ_INSTANCE_ID="+o.InstanceID,
		"BUZZ_LOG_FORMAT=json",
		"BUZZ_LOG_LEVEL=debug",
	)
	if o.HookDir != "" {
		env = append(env, "BUZZ_HOOK_DIR="+o.HookDir, "BUZZ_HOOKS="+strings.Join(o.Hooks, ","))
	}
	for k, v := range o.Env {
		env = append(env, k+"="+v)
	}
	cmd.Env = env
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	cmd.Stderr = io.MultiWriter(logf, pw)
	cmd.Stdout = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &Relay{InstanceID: o.InstanceID, Cmd: cmd, LogPath: logPath, done: make(chan struct{}), t: t}
	go func() {
		r.exitErr = cmd.Wait()
		pw.Close()
		logf.Close()
		close(r.done)
	}()
	addrc := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		sent := false
		for sc.Scan() {
			if sent {
				continue
			}
			var line struct {
				Msg  string `json:"msg"`
				Addr string `json:"addr"`
			}
			if json.Unmarshal(sc.Bytes(), &line) == nil && line.Msg == "listening" && line.Addr != "" {
				addrc <- line.Addr
				sent = true
			}
		}
		io.Copy(io.Discard, pr)
	}()
	t.Cleanup(func() {
		r.Stop()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			if len(b) > 20000 {
				b = b[len(b)-20000:]
			}
			t.Logf("buzzpg %s log (tail):\n%s", o.InstanceID, b)
		}
	})
	select {
	case addr := <-addrc:
		r.URL = "ws://" + addr
		r.HTTPURL = "http://" + addr
	case <-r.done:
		b, _ := os.ReadFile(logPath)
		t.Fatalf("buzzpg serve exited before listening: %v\n%s", r.exitErr, b)
	case <-time.After(60 * time.Second):
		b, _ := os.ReadFile(logPath)
		t.Fatalf("buzzpg serve did not start listening within 60s\n%s", b)
	}
	if !o.NoWaitReady {
		r.WaitReady(t, 60*time.Second)
	}
	return r
}

// WaitReady polls /readyz until it answers 200.
func (r *Relay) WaitReady(t testing.TB, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		resp, err := http.Get(r.HTTPURL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		select {
		case <-r.done:
			t.Fatalf("buzzpg %s exited: %v", r.InstanceID, r.exitErr)
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("buzzpg %s not ready within %s", r.InstanceID, timeout)
}

// Kill sends SIGKILL (a crash) and waits for the process to go.
func (r *Relay) Kill() {
	if r.Cmd.Process != nil {
		_ = syscall.Kill(-r.Cmd.Process.Pid, syscall.SIGKILL)
	}
	<-r.done
}

// Stop sends SIGTERM (graceful shutdown) and waits up to 30s, then kills.
func (r *Relay) Stop() {
	select {
	case <-r.done:
		return
	default:
	}
	_ = r.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(30 * time.Second):
		r.Kill()
	}
}

// Done is closed when the process has exited.
func (r *Relay) Done() <-chan struct{} { return r.done }

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
