package main

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/hooks"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// A migration that ends between start-up's read of the version (dirty, lock held) and its look at
// the lock (free) finished; it did not fail. golang-migrate records (N, clean) and only then lets
// go of its lock, so the version is read again before "a migration failed" is said.
func TestSchemaCheckRereadsAMigrationThatEndedBetweenItsReads(t *testing.T) {
	ctx := context.Background()
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	latest := int(db.LatestVersion())
	drv := testenv.MigrationDriver(t, url)
	if err := drv.Lock(); err != nil {
		t.Fatal(err)
	}
	if err := drv.SetVersion(latest, true); err != nil { // file `latest` running
		t.Fatal(err)
	}
	ended := 0
	defer hooks.Set(hookSchemaRead, func(context.Context) {
		if ended++; ended > 1 {
			return
		}
		// The migration finishes as golang-migrate ends one: the clean version, then the lock.
		if err := drv.SetVersion(latest, false); err != nil {
			t.Error(err)
		}
		if err := drv.Unlock(); err != nil {
			t.Error(err)
		}
	})()
	err := waitForSchema(ctx, pool, slog.New(slog.DiscardHandler))
	if ended == 0 {
		t.Fatal("the schema check never reached the point between its reads")
	}
	if err != nil {
		t.Fatalf("start-up after a migration that finished between the schema reads: %v, want it to serve", err)
	}

	// A dirty version with nobody holding the lock, read twice, is still a failed migration.
	if err := drv.SetVersion(latest, true); err != nil {
		t.Fatal(err)
	}
	if err := waitForSchema(ctx, pool, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "dirty") {
		t.Fatalf("start-up on a failed migration: %v, want the dirty advice", err)
	}
}

// A signal that lands while start-up reads a dirty version a second time is no news about the
// schema: checkSchema says it was cut short (so serve exits 0 on the signal), never the
// failed-migration advice that would send an operator to `migrate force`.
func TestSchemaCheckCutShortOnItsRereadIsNotAFailedMigration(t *testing.T) {
	url := testenv.FreshDB(t)
	pool := testenv.Pool(t, url)
	drv := testenv.MigrationDriver(t, url)
	if err := drv.SetVersion(int(db.LatestVersion()), true); err != nil { // failed, nobody holds the lock
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	reached := false
	defer hooks.Set(hookSchemaReread, func(context.Context) { reached = true; cancel() })()
	err := checkSchema(ctx, pool)
	if !reached {
		t.Fatal("the schema check never reached its second read")
	}
	if !errors.Is(err, context.Canceled) || strings.Contains(err.Error(), "force") {
		t.Fatalf("schema check cancelled before its re-read: %v, want context.Canceled and no failed-migration advice", err)
	}
}
