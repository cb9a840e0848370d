package db_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// serverURLWith is the test server's URL with the database and, if given, the user replaced.
func serverURLWith(t *testing.T, database, user string) string {
	t.Helper()
	u, err := url.Parse(testenv.ServerURL(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + database
	if user != "" {
		u.User = url.User(user)
	}
	return u.String()
}

// A refusal that waiting cannot change ends the wait at once, naming what was refused, instead of
// being retried for the whole BUZZ_DB_WAIT and then blamed on a server that is not running.
func TestWaitReachableFailsAtOnceOnPermanentRefusals(t *testing.T) {
	for _, c := range []struct {
		name, url string
		want      []string
	}{
		{"no such database", serverURLWith(t, "buzz_no_such_database", ""), []string{`has no database "buzz_no_such_database"`, "3D000", "DATABASE_URL"}},
		// Under trust authentication an unknown role is still refused with class 28 (28000).
		{"no such role", serverURLWith(t, "postgres", "buzz_no_such_role"), []string{`refused the login of role "buzz_no_such_role"`, "28000", "pg_hba.conf"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			began := time.Now()
			err := db.WaitReachable(context.Background(), c.url, time.Minute, nil)
			if took := time.Since(began); took > 5*time.Second {
				t.Fatalf("WaitReachable took %s for a permanent refusal (wait 1m): %v", took, err)
			}
			if err == nil {
				t.Fatal("WaitReachable succeeded")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not say %q: %v", w, err)
				}
			}
			if strings.Contains(err.Error(), "is it running") {
				t.Errorf("error blames a server that answered: %v", err)
			}
		})
	}
}

// A stop while waiting (SIGTERM during start-up) ends the wait with the context's error, not
// with "is it running?".
func TestWaitReachableStopsWithItsContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(300*time.Millisecond, cancel)
	began := time.Now()
	err := db.WaitReachable(ctx, "postgres://postgres@127.0.0.1:1/x?sslmode=disable", time.Minute, nil)
	if took := time.Since(began); took > 5*time.Second {
		t.Fatalf("WaitReachable took %s to notice its context ended", took)
	}
	if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "is it running") {
		t.Fatalf("WaitReachable after cancel: %v, want context.Canceled alone", err)
	}
}
