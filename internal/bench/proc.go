package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// ProcOpts starts one `buzzpg serve` process.
type ProcOpts struct {
	Bin         string // path of the buzzpg binary
	DatabaseURL string
	RelayKey    string // hex secret key, shared by all processes
	InstanceID  string
	Listen      string   // default 127.0.0.1:0
	Env         []string // extra KEY=VALUE
	LogPath     string   // where stdout+stderr go (appended)
	LogLevel    string   // default info; must be info or debug (the "listening" line is info)
}

// Proc is a running `buzzpg serve`.
type Proc struct {
	Opts    ProcOpts
	URL     string // ws://addr
	HTTPURL string
	Addr    string
	cmd     *exec.Cmd
	done    chan struct{}
	exitErr error
}

// StartServe starts the process and waits until it is listening and /readyz answers 200.
func StartServe(o ProcOpts, timeout time.Duration) (*Proc, error) {
	if o.Listen == "" {
		o.Listen = "127.0.0.1:0"
	}
	if o.LogLevel == "" {
		o.LogLevel = "info"
	}
	deadline := time.Now().Add(timeout)
	p, stderr, err := startProc(o)
	if err != nil {
		return nil, err
	}
	select {
	case addr := <-listeningAddr(stderr):
		p.Addr = addr
		p.URL = "ws://" + addr
		p.HTTPURL = "http://" + addr
	case <-p.done:
		return nil, fmt.Errorf("buzzpg serve %s exited before listening: %v (log %s)", o.InstanceID, p.exitErr, o.LogPath)
	case <-time.After(timeout):
		p.Kill()
		return nil, fmt.Errorf("buzzpg serve %s did not listen within %s (log %s)", o.InstanceID, timeout, o.LogPath)
	}
	if err := p.waitReady(deadline, timeout); err != nil {
		return nil, err
	}
	return p, nil
}

// startProc starts `buzzpg serve` in its own process group, its output appended to o.LogPath;
// stderr is a copy of its standard error.
func startProc(o ProcOpts) (p *Proc, stderr io.Reader, err error) {
	cmd := exec.Command(o.Bin, "serve")
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+o.DatabaseURL,
		"BUZZ_LISTEN="+o.Listen,
		"BUZZ_RELAY_URL=",
		"BUZZ_RELAY_KEY="+o.RelayKey,
		"BUZZ_RELAY_KEY_FILE=",
		"BUZZ_INSTANCE_ID="+o.InstanceID,
		"BUZZ_LOG_FORMAT=json",
		"BUZZ_LOG_LEVEL="+o.LogLevel,
	)
	cmd.Env = append(cmd.Env, o.Env...)
	var logw io.Writer = io.Discard
	var logf *os.File
	if o.LogPath != "" {
		f, err := os.OpenFile(o.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, nil, err
		}
		logf, logw = f, f
	}
	pr, pw := io.Pipe()
	cmd.Stdout = logw
	cmd.Stderr = io.MultiWriter(logw, pw)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	p = &Proc{Opts: o, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.exitErr = cmd.Wait()
		pw.Close()
		if logf != nil {
			logf.Close()
		}
		close(p.done)
	}()
	return p, pr, nil
}

// listeningAddr reads the JSON log for the "listening" line and sends its address; the rest of
// the log is drained.
func listeningAddr(log io.Reader) <-chan string {
	addrc := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(log)
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
		_, _ = io.Copy(io.Discard, log)
	}()
	return addrc
}

// waitReady polls /readyz until it answers 200, the process exits, or the deadline (then it is killed).
func (p *Proc) waitReady(deadline time.Time, timeout time.Duration) error {
	o := p.Opts
	for {
		if err := Ready(p.HTTPURL); err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("buzzpg serve %s exited before ready: %v (log %s)", o.InstanceID, p.exitErr, o.LogPath)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.Kill()
			return fmt.Errorf("buzzpg serve %s not ready within %s (log %s)", o.InstanceID, timeout, o.LogPath)
		}
	}
}

// Ready asks /readyz once.
func Ready(httpURL string) error {
	c := http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(httpURL + "/readyz")
	if err != nil {
		return err
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("readyz %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))
	}
	return nil
}

// Kill sends SIGKILL to the process group (a crash) and waits for it to go.
func (p *Proc) Kill() {
	if p.cmd.Process != nil {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
	<-p.done
}

// Stop sends SIGTERM and waits up to grace, then kills.
func (p *Proc) Stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		p.Kill()
	}
}

// Done is closed when the process has exited.
func (p *Proc) Done() <-chan struct{} { return p.done }

// Pid is the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// ExitErr is how the process ended (after Done).
func (p *Proc) ExitErr() error { return p.exitErr }

// HTTPOf turns ws://host into http://host.
func HTTPOf(wsURL string) string {
	if strings.HasPrefix(wsURL, "wss://") {
		return "https://" + strings.TrimPrefix(wsURL, "wss://")
	}
	return "http://" + strings.TrimPrefix(wsURL, "ws://")
}

// RelayPubkey reads the relay's pubkey from its NIP-11 document.
func RelayPubkey(wsURL string) (string, error) {
	req, _ := http.NewRequest("GET", strings.TrimRight(HTTPOf(wsURL), "/")+"/", nil)
	req.Header.Set("Accept", "application/nostr+json")
	c := http.Client{Timeout: 5 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	var doc struct {
		Pubkey string `json:"pubkey"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		return "", fmt.Errorf("NIP-11 of %s: %w", wsURL, err)
	}
	return doc.Pubkey, nil
}
