// Package testenv starts the real parts tests talk to: a migrated PostgreSQL database per test
// package (cloned from a template, so it is cheap) and real `buzzpg serve` processes.
package testenv

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/db"
	buzzsql "github.com/buzzpg/buzzpg/sql"
)

var (
	baseOnce sync.Once
	baseURL  string
	baseErr  error

	pkgOnce sync.Once
	pkgURL  string
	pkgErr  error
)

// RepoRoot is the directory holding go.mod.
func RepoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// ServerURL is the URL of the server tests use (any database on it).
func ServerURL(t testing.TB) string {
	t.Helper()
	baseOnce.Do(func() {
		if u := os.Getenv("DATABASE_URL"); u != "" {
			baseURL = u
			return
		}
		script := filepath.Join(RepoRoot(), "scripts", "pg.sh")
		if out, err := exec.Command(script, "start").CombinedOutput(); err != nil {
			baseErr = fmt.Errorf("scripts/pg.sh start: %v: %s", err, out)
			return
		}
		out, err := exec.Command(script, "url").Output()
		if err != nil {
			baseErr = err
			return
		}
		baseURL = strings.TrimSpace(string(out))
	})
	if baseErr != nil {
		t.Fatalf("testenv: %v", baseErr)
	}
	return baseURL
}

func withDatabase(u, name string) string {
	w, err := db.WithDatabase(u, name)
	if err != nil {
		panic(err)
	}
	return w
}

// migrationsHash names the template after the migration files, so a changed migration gets a
// new template instead of a stale one.
func migrationsHash() string {
	h := sha256.New()
	_ = fs.WalkDir(buzzsql.FS, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, _ := buzzsql.FS.ReadFile(path)
		h.Write([]byte(path))
		h.Write(b)
		return nil
	})
	return hex.EncodeToString(h.Sum(nil))[:12]
}

func adminConn(ctx context.Context, t testing.TB) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(ctx, withDatabase(ServerURL(t), "postgres"))
	if err != nil {
		t.Fatalf("testenv: connect admin: %v", err)
	}
	return c
}

// template returns the name of a migrated template database, creating it once per server
// (serialised across test binaries by an advisory lock).
func template(ctx context.Context, t testing.TB) string {
	t.Helper()
	name := "buzz_tpl_" + migrationsHash()
	c := adminConn(ctx, t)
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, `SELECT pg_advisory_lock(727272)`); err != nil {
		t.Fatalf("testenv: lock: %v", err)
	}
	defer c.Exec(ctx, `SELECT pg_advisory_unlock(727272)`)
	// A failed look-up must not be read as "no template": the DROP below would then force-drop a
	// template that other test binaries may be cloning right now.
	var exists bool
	if err := c.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname=$1 AND datistemplate)`, name).Scan(&exists); err != nil {
		t.Fatalf("testenv: look up template %s: %v", name, err)
	}
	if exists {
		return name
	}
	_, _ = c.Exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`)
	if _, err := c.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("testenv: create template: %v", err)
	}
	if err := db.MigrateUp(withDatabase(ServerURL(t), name), nil); err != nil {
		t.Fatalf("testenv: migrate template: %v", err)
	}
	if _, err := c.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{name}.Sanitize()+` WITH is_template true`); err != nil {
		t.Fatalf("testenv: mark template: %v", err)
	}
	return name
}

var safeName = regexp.MustCompile(`[^a-z0-9_]+`)

func createFrom(ctx context.Context, t testing.TB, tpl, name string) string {
	t.Helper()
	c := adminConn(ctx, t)
	defer c.Close(ctx)
	var err error
	for i := 0; i < 50; i++ {
		_, err = c.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()+` TEMPLATE `+pgx.Identifier{tpl}.Sanitize())
		if err == nil || !strings.Contains(err.Error(), "being accessed by other users") {
			break
		}
		time.Sleep(100 * time.Millisecond) // another binary is cloning the same template right now
	}
	if err != nil {
		t.Fatalf("testenv: create database %s: %v", name, err)
	}
	return withDatabase(ServerURL(t), name)
}

func dbName(prefix string) string {
	exe := filepath.Base(os.Args[0])
	exe = strings.TrimSuffix(exe, ".test")
	n := fmt.Sprintf("%s_%s_%d_%d", prefix, safeName.ReplaceAllString(strings.ToLower(exe), "_"), os.Getpid(), time.Now().UnixNano()%1e6)
	if len(n) > 60 {
		n = n[:60]
	}
	return n
}

// DB returns the URL of this test package's own migrated database (one per test binary).
func DB(t testing.TB) string {
	t.Helper()
	pkgOnce.Do(func() {
		// template and createFrom end the first test with t.Fatal on failure; every later test
		// then gets this error instead of an empty URL.
		defer func() {
			if pkgURL == "" {
				pkgErr = errors.New("testenv: this package's database could not be set up (see the first failing test)")
			}
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		tpl := template(ctx, t)
		pkgURL = createFrom(ctx, t, tpl, dbName("buzz_t"))
	})
	if pkgErr != nil {
		t.Fatal(pkgErr)
	}
	return pkgURL
}

// FreshDB returns the URL of a new migrated database for this test alone, dropped afterwards
// (with any replication slots on it).
func FreshDB(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	tpl := template(ctx, t)
	name := dbName("buzz_f")
	u := createFrom(ctx, t, tpl, name)
	t.Cleanup(func() { DropDB(t, name) })
	return u
}

// DropDB drops a database with db.DropDatabase (its replication slots first).
func DropDB(t testing.TB, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c := adminConn(ctx, t)
	defer c.Close(ctx)
	if err := db.DropDatabase(ctx, c, name); err != nil {
		t.Logf("testenv: drop %s: %v", name, err)
	}
}

// Pool opens a pool on url for the test, closed at cleanup.
func Pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	p, err := db.NewPool(context.Background(), url, "buzzpg-test", 16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// DatabaseName returns the database part of url.
func DatabaseName(u string) string {
	p, _ := url.Parse(u)
	return strings.TrimPrefix(p.Path, "/")
}

// EmptyDB returns the URL of a new database with no buzz schema at all (for migration tests),
// dropped afterwards.
func EmptyDB(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The migrated template exists first: its migration creates the cluster-wide roles under a
	// lock, so migrations of empty databases never race each other creating them.
	template(ctx, t)
	name := dbName("buzz_f")
	c := adminConn(ctx, t)
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("testenv: create %s: %v", name, err)
	}
	t.Cleanup(func() { DropDB(t, name) })
	return withDatabase(ServerURL(t), name)
}
