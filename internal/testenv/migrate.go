package testenv

import (
	"testing"

	"github.com/golang-migrate/migrate/v4/database"

	"github.com/buzzpg/buzzpg/internal/db"
)

// MigrationDriver opens golang-migrate's own pgx/v5 driver on url, as `buzzpg migrate` does: its
// Lock is the advisory lock a real migration holds, its SetVersion the row a real one writes.
func MigrationDriver(t testing.TB, url string) database.Driver {
	t.Helper()
	u, err := db.MigrateURL(url)
	if err != nil {
		t.Fatal(err)
	}
	drv, err := database.Open(u)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = drv.Close() })
	return drv
}
