package testenv

import (
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/buzzpg/buzzpg/internal/db"
)

// Cluster is a PostgreSQL cluster of one test's own, beside the shared one the other tests use:
// the test may crash-restart it without disturbing test packages running at the same time. It
// always owns its server, so restart tests on it never need to skip.
type Cluster struct {
	Dir  string // BUZZ_PGDATA for scripts/pg.sh (which may link it somewhere the postgres user can reach)
	Port int
	url  string // of the database pg.sh creates

	// KeepIfFailed keeps the data directory of a failed test for a post-mortem (it is removed
	// otherwise). Read at cleanup.
	KeepIfFailed bool

	migrateOnce sync.Once
	migrateErr  error
}

// Ports of private clusters are derived from their names, below Linux's ephemeral range
// (32768-60999, where relays listening on :0 land) and away from the shared cluster's 54329.
const (
	clusterPortBase  = 25000
	clusterPortRange = 5000
)

// PrivateCluster initialises and starts a new cluster for t with scripts/pg.sh, stopped and
// removed at cleanup. name (e.g. the package's) fixes the port, so clusters of packages that run
// in parallel under distinct names do not race for one port; a port already taken (a leftover
// cluster, an unrelated listener) is skipped.
func PrivateCluster(t testing.TB, name string) *Cluster {
	t.Helper()
	tmp, err := os.MkdirTemp("", "buzzpg-pg-"+safeName.ReplaceAllString(strings.ToLower(name), "_")+"-")
	if err != nil {
		t.Fatal(err)
	}
	c := &Cluster{Dir: filepath.Join(tmp, "pg"), Port: clusterPort(t, name)}
	t.Cleanup(func() { c.remove(t, tmp) })
	if out, err := c.pgScript("start"); err != nil {
		t.Fatalf("testenv: private cluster %s (scripts/pg.sh start on port %d): %v\n%s", name, c.Port, err, out)
	}
	out, err := c.pgScript("url")
	if err != nil {
		t.Fatalf("testenv: pg.sh url: %v %s", err, out)
	}
	c.url = strings.TrimSpace(string(out))
	return c
}

func clusterPort(t testing.TB, name string) int {
	t.Helper()
	h := fnv.New32a()
	h.Write([]byte(name))
	start := int(h.Sum32() % clusterPortRange)
	for i := 0; i < 100; i++ {
		p := clusterPortBase + (start+i)%clusterPortRange
		if l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p)); err == nil {
			l.Close()
			return p
		}
	}
	t.Fatalf("testenv: no free port for private cluster %s", name)
	return 0
}

func (c *Cluster) pgScript(args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(RepoRoot(), "scripts", "pg.sh"), args...)
	cmd.Env = append(os.Environ(), "BUZZ_PGDATA="+c.Dir, fmt.Sprintf("BUZZ_PGPORT=%d", c.Port), "BUZZ_PGDATABASE=buzzpg")
	return cmd.CombinedOutput()
}

// URL is the URL of database name on the cluster ("" for the one pg.sh created).
func (c *Cluster) URL(name string) string {
	if name == "" {
		return c.url
	}
	return withDatabase(c.url, name)
}

// MigratedURL migrates the cluster's database (once) and returns its URL.
func (c *Cluster) MigratedURL(t testing.TB) string {
	t.Helper()
	c.migrateOnce.Do(func() { c.migrateErr = db.MigrateUp(c.url, nil) })
	if c.migrateErr != nil {
		t.Fatalf("testenv: migrate private cluster: %v", c.migrateErr)
	}
	return c.url
}

// Restart is an immediate (crash) restart: pg_ctl -m immediate stop, then start. It returns an
// error rather than failing the test, so fault injectors may call it from any goroutine.
func (c *Cluster) Restart() error {
	if out, err := c.pgScript("restart"); err != nil {
		return fmt.Errorf("pg.sh restart: %v: %s", err, out)
	}
	return nil
}

// Stop shuts the cluster down (fast mode) until Start: an outage, not a crash.
func (c *Cluster) Stop() error {
	if out, err := c.pgScript("stop"); err != nil {
		return fmt.Errorf("pg.sh stop: %v: %s", err, out)
	}
	return nil
}

// Start starts the cluster again after Stop.
func (c *Cluster) Start() error {
	if out, err := c.pgScript("start"); err != nil {
		return fmt.Errorf("pg.sh start: %v: %s", err, out)
	}
	return nil
}

// remove stops the cluster and deletes its files (unless kept).
func (c *Cluster) remove(t testing.TB, tmp string) {
	real, _ := filepath.EvalSymlinks(c.Dir)
	_, _ = c.pgScript("stop")
	if c.KeepIfFailed && t.Failed() {
		t.Logf("testenv: private cluster data kept: %s", real)
		return
	}
	// As root, pg.sh keeps the cluster in /var/tmp/buzzpg-<hash>/pg (reachable by the postgres
	// user) and links it from Dir: that directory is this cluster's alone.
	if parent := filepath.Dir(real); real != "" && real != c.Dir && strings.HasPrefix(filepath.Base(parent), "buzzpg-") {
		_ = os.RemoveAll(parent)
	}
	_ = os.RemoveAll(tmp)
}
