package ops

import (
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// While a process drains after SIGTERM, its /readyz answers 503 "shutting down": the process is
// held right after its shutdown began (a test hook), and the operator's /readyz, which serves
// until the end, is asked then.
func TestReadyzSaysShuttingDownWhileDraining(t *testing.T) {
	opsAddr := freeAddr(t)
	hookDir := t.TempDir()
	const hook = "serve.shutdown_begun"
	r := testenv.StartRelay(t, testenv.RelayOpts{
		Env:     map[string]string{"BUZZ_METRICS_LISTEN": opsAddr},
		HookDir: hookDir, Hooks: []string{hook},
	})
	ops := "http://" + opsAddr
	if code, body := get(t, ops+"/readyz"); code != http.StatusOK {
		t.Fatalf("/readyz before the signal: %d %q", code, body)
	}
	if err := syscall.Kill(r.Pid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	hooks.Wait(t, hookDir, hook, 30*time.Second)
	code, body := get(t, ops+"/readyz")
	hooks.Release(t, hookDir, hook)
	if code != http.StatusServiceUnavailable || strings.TrimSpace(body) != "shutting down" {
		t.Fatalf("/readyz while draining: %d %q, want 503 \"shutting down\"", code, body)
	}
	if code := r.ExitCode(); code != 0 {
		t.Fatalf("exit %d after SIGTERM:\n%s", code, r.Log())
	}
}
