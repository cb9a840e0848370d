// Command dropdbs drops the databases earlier test runs left behind (buzz_t_*, buzz_f_*,
// buzz_tpl_*) on the server of the URL it is given, each with db.DropDatabase (slots first).
// scripts/pg.sh dropdbs runs it before `make test`.
package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/buzzpg/buzzpg/internal/db"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: dropdbs SERVER_URL")
		os.Exit(2)
	}
	if err := dropAll(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "dropdbs:", err)
		os.Exit(1)
	}
}

func dropAll(serverURL string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	u, err := db.WithDatabase(serverURL, "postgres")
	if err != nil {
		return err
	}
	c, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer c.Close(ctx)
	rows, err := c.Query(ctx, `SELECT datname FROM pg_database WHERE datname ~ '^buzz_(t|f|tpl)_'`)
	if err != nil {
		return err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, name := range names {
		if err := db.DropDatabase(ctx, c, name); err != nil {
			fmt.Fprintf(os.Stderr, "dropdbs: %s: %v\n", name, err)
		}
	}
	return nil
}
