package db

import (
	"context"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5"
)

// WithDatabase returns u naming database name instead.
func WithDatabase(u, name string) (string, error) {
	p, err := url.Parse(u)
	if err != nil {
		return "", err
	}
	p.Path = "/" + name
	return p.String(), nil
}

// DropDatabase drops database name through c, a connection to another database of the server.
// The replication slots on it go first (a slot blocks the drop, and an active one is ended
// first: its walsender is terminated, and the slot dropped once it is free), and a template is
// unmarked (a template cannot be dropped). Used by the load tool, the tests and
// scripts/pg.sh dropdbs (through scripts/dropdbs).
func DropDatabase(ctx context.Context, c *pgx.Conn, name string) error {
	_, _ = c.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database=$1 AND active_pid IS NOT NULL`, name)
	for i := 0; i < 100; i++ {
		_, _ = c.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database=$1 AND NOT active`, name)
		var left int
		_ = c.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE database=$1`, name).Scan(&left)
		if left == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	id := pgx.Identifier{name}.Sanitize()
	_, _ = c.Exec(ctx, `ALTER DATABASE `+id+` WITH is_template false`) // fails harmlessly when it is gone
	_, err := c.Exec(ctx, `DROP DATABASE IF EXISTS `+id+` WITH (FORCE)`)
	return err
}
