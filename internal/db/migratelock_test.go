package db_test

import (
	"context"
	"testing"

	"github.com/buzzpg/buzzpg/internal/db"
	"github.com/buzzpg/buzzpg/internal/testenv"
)

// MigrationRunning finds the lock golang-migrate's own driver takes (its key hashes the database
// name as the driver sees it, the schema and the pinned table), and nothing once it is released.
func TestMigrationRunningSeesGolangMigratesLock(t *testing.T) {
	ctx := context.Background()
	url := testenv.EmptyDB(t)
	drv := testenv.MigrationDriver(t, url)
	pool := testenv.Pool(t, url)
	running := func() bool {
		t.Helper()
		held, err := db.MigrationRunning(ctx, pool)
		if err != nil {
			t.Fatal(err)
		}
		return held
	}
	if running() {
		t.Fatal("a migration is reported running before anyone took the lock")
	}
	if err := drv.Lock(); err != nil {
		t.Fatal(err)
	}
	if !running() {
		t.Fatal("golang-migrate's lock is held, and no migration is reported running")
	}
	if err := drv.Unlock(); err != nil {
		t.Fatal(err)
	}
	if running() {
		t.Fatal("a migration is reported running after the lock was released")
	}
}
