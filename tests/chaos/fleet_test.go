package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/bench"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// freePort picks a free port below Linux's ephemeral range (32768-60999): a relay slot keeps its
// port across restarts, and while it is down an outgoing connection could take an ephemeral one.
func freePort(t *testing.T) int {
	t.Helper()
	for i := 0; i < 200; i++ {
		p := 20000 + rand.IntN(12000)
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p)); err == nil {
			l.Close()
			return p
		}
	}
	t.Fatal("chaos: no free port in 20000-31999")
	return 0
}

// fleet supervises the relay processes: slot i always listens on the same port, each incarnation
// gets a fresh instance id (as a restarted process with the default random id would).
type fleet struct {
	t      *testing.T
	bin    string
	dbURL  string
	key    string
	env    []string
	logDir string
	ports  []int
	proxy  []*testenv.TCPProxy // slot i reaches PostgreSQL only through proxy[i]
	logf   func(string, ...any)

	mu          sync.Mutex
	procs       []*bench.Proc
	incarnation []int
	unexpected  []string // processes that exited on their own (not killed by the soak)
	killed      map[*bench.Proc]bool
	stopping    bool
}

func newFleet(t *testing.T, n int, bin, dbURL, key, logDir string, env []string, logf func(string, ...any)) *fleet {
	f := &fleet{t: t, bin: bin, dbURL: dbURL, key: key, env: env, logDir: logDir, logf: logf,
		procs: make([]*bench.Proc, n), incarnation: make([]int, n), killed: map[*bench.Proc]bool{}}
	for i := 0; i < n; i++ {
		f.ports = append(f.ports, freePort(t))
		f.proxy = append(f.proxy, testenv.StartTCPProxy(t, testenv.TargetOf(t, dbURL)))
	}
	t.Cleanup(f.stopAll)
	return f
}

// start (re)starts slot i and waits until it is ready.
func (f *fleet) start(i int) error {
	f.mu.Lock()
	f.incarnation[i]++
	inst := fmt.Sprintf("chaos%d_%d", i, f.incarnation[i])
	f.mu.Unlock()
	var p *bench.Proc
	var err error
	for try := 0; try < 5; try++ {
		p, err = bench.StartServe(bench.ProcOpts{Bin: f.bin, DatabaseURL: f.proxy[i].ProxyURL(f.t, f.dbURL), RelayKey: f.key, InstanceID: inst,
			Listen: fmt.Sprintf("127.0.0.1:%d", f.ports[i]), Env: f.env, LogPath: filepath.Join(f.logDir, fmt.Sprintf("relay%d.log", i)),
			LogLevel: "info"}, 90*time.Second)
		if err == nil {
			break
		}
		f.logf("relay %d (%s) failed to start (try %d): %v", i, inst, try+1, err)
		time.Sleep(time.Second)
	}
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.procs[i] = p
	f.mu.Unlock()
	f.logf("relay %d up: %s pid %d on %s", i, inst, p.Pid(), p.URL)
	go func() {
		<-p.Done()
		f.mu.Lock()
		defer f.mu.Unlock()
		if !f.killed[p] && !f.stopping {
			msg := fmt.Sprintf("relay %d (%s) exited on its own at %s: %v", i, inst, time.Now().Format("15:04:05.000"), p.ExitErr())
			f.unexpected = append(f.unexpected, msg)
			f.logf("%s", msg)
		}
		if f.procs[i] == p {
			f.procs[i] = nil
		}
	}()
	return nil
}

// kill sends SIGKILL to slot i.
func (f *fleet) kill(i int) bool {
	f.mu.Lock()
	p := f.procs[i]
	if p != nil {
		f.killed[p] = true
	}
	f.mu.Unlock()
	if p == nil {
		return false
	}
	p.Kill()
	f.logf("relay %d killed (kill -9 pid %d)", i, p.Pid())
	return true
}

// signal sends sig (SIGSTOP, SIGCONT) to slot i's process; false when it is not running.
func (f *fleet) signal(i int, sig syscall.Signal) (pid int, ok bool) {
	f.mu.Lock()
	p := f.procs[i]
	f.mu.Unlock()
	if p == nil {
		return 0, false
	}
	return p.Pid(), syscall.Kill(p.Pid(), sig) == nil
}

// proc is slot i's running process (nil while down).
func (f *fleet) proc(i int) *bench.Proc {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.procs[i]
}

// instance is the instance id of slot i's current (or last) incarnation.
func (f *fleet) instance(i int) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return fmt.Sprintf("chaos%d_%d", i, f.incarnation[i])
}

// rssMB is VmRSS of slot i's process in MiB (0 when it is not running).
func (f *fleet) rssMB(i int) float64 {
	p := f.proc(i)
	if p == nil {
		return 0
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.Pid()))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

// live returns the URLs of running processes.
func (f *fleet) live() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, p := range f.procs {
		if p != nil {
			select {
			case <-p.Done():
			default:
				out = append(out, p.URL)
			}
		}
	}
	return out
}

func (f *fleet) down() []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []int
	for i, p := range f.procs {
		if p == nil {
			out = append(out, i)
		}
	}
	return out
}

func (f *fleet) stopAll() {
	f.mu.Lock()
	f.stopping = true
	ps := append([]*bench.Proc(nil), f.procs...)
	f.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range ps {
		if p != nil {
			_ = syscall.Kill(p.Pid(), syscall.SIGCONT) // a frozen process would not hear SIGTERM
			wg.Add(1)
			go func(p *bench.Proc) { defer wg.Done(); p.Stop(15 * time.Second) }(p)
		}
	}
	wg.Wait()
}

func (f *fleet) unexpectedExits() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.unexpected...)
}

func ctxTimeout(d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), d)
}
