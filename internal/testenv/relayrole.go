package testenv

import (
	"context"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/db"
)

// RelayLogin is the role relays run as in tests, as in a deployment: a login member of buzz_relay
// with REPLICATION, not the superuser that owns the schema (scripts/pg.sh makes the same one for
// `make run`).
const RelayLogin = "buzz_relay_login"

// AsRole returns u with its user replaced by role (no password: the test server trusts loopback).
func AsRole(t testing.TB, u, role string) string {
	t.Helper()
	p, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	p.User = url.User(role)
	return p.String()
}

// relayURL is the URL a relay started on dbURL runs with. The test's own URL (the server's admin
// role) becomes RelayLogin's, unless the schema is not current: then the relay has migrations to
// run, which only the owner may do. A URL naming another role is the test's choice and is kept,
// and so is every URL when asOwner is set.
func relayURL(t testing.TB, dbURL string, asOwner bool) string {
	t.Helper()
	p, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := url.Parse(ServerURL(t))
	if err != nil {
		t.Fatal(err)
	}
	if asOwner || p.User.Username() != admin.User.Username() || !schemaCurrent(dbURL) {
		return dbURL
	}
	// Made each time, not once per address: a private cluster (the chaos soak's) may come and go
	// on the same port.
	if err := ensureRelayLogin(dbURL); err != nil {
		t.Logf("testenv: relays run as %s: cannot create role %s: %v", admin.User.Username(), RelayLogin, err)
		return dbURL
	}
	return AsRole(t, dbURL, RelayLogin)
}

// schemaCurrent reports whether dbURL's schema is migrated, clean, to this binary's version.
func schemaCurrent(dbURL string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return false
	}
	defer c.Close(ctx)
	var version int64
	var dirty bool
	if err := c.QueryRow(ctx, `SELECT version, dirty FROM `+db.MigrationsTable).Scan(&version, &dirty); err != nil {
		return false
	}
	return !dirty && version == int64(db.LatestVersion())
}

// ensureRelayLogin creates RelayLogin on dbURL's server (roles are cluster-wide; the lock keeps
// test binaries starting together from racing on it).
func ensureRelayLogin(dbURL string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, withDatabase(dbURL, "postgres"))
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, `SELECT pg_advisory_lock(727273)`); err != nil {
		return err
	}
	defer c.Exec(ctx, `SELECT pg_advisory_unlock(727273)`)
	_, err = c.Exec(ctx, `DO $$ BEGIN
		IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '`+RelayLogin+`') THEN
		  CREATE ROLE `+RelayLogin+` LOGIN REPLICATION IN ROLE buzz_relay;
		END IF; END $$`)
	return err
}
