package main

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/golang-migrate/migrate/v4"

	"github.com/buzzpg/buzzpg/internal/db"
)

func runMigrate(args []string) error {
	if len(args) < 1 {
		return errors.New("usage: buzzpg migrate up | down N | down all | version | force VERSION")
	}
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		return errors.New("DATABASE_URL is not set")
	}
	log := newLogger(os.Getenv("BUZZ_LOG_FORMAT"), os.Getenv("BUZZ_LOG_LEVEL"))
	switch args[0] {
	case "up":
		return db.MigrateUp(url, log)
	case "down":
		// Down migrations drop data (the last one drops schema buzz): say how far, explicitly.
		steps := 0
		if len(args) == 2 && args[1] == "all" {
			steps = -1
		} else if len(args) == 2 {
			if n, err := strconv.Atoi(args[1]); err == nil && n > 0 {
				steps = n
			}
		}
		if steps == 0 {
			return errors.New("usage: buzzpg migrate down N (undo the last N migrations) or down all (drops schema buzz and every event)")
		}
		m, err := db.NewMigrator(url, log)
		if err != nil {
			return err
		}
		defer m.Close()
		if cur, _, verr := m.Version(); verr == nil && steps > 0 && uint(steps) >= cur {
			// golang-migrate would run every down file, the last dropping schema buzz, before
			// reporting that there were fewer than N.
			return fmt.Errorf("the database is at version %d: down %d would drop schema buzz and every event; say `down all` if that is what you want", cur, steps)
		}
		if steps < 0 {
			err = m.Down()
		} else {
			err = m.Steps(-steps)
		}
		if err != nil && !errors.Is(err, migrate.ErrNoChange) {
			return err
		}
		return nil
	case "version":
		v, dirty, current, err := db.SchemaStatus(url)
		if err != nil {
			return err
		}
		fmt.Printf("version %d dirty=%v current=%v (binary has %d)\n", v, dirty, current, db.LatestVersion())
		return nil
	case "force":
		if len(args) < 2 {
			return errors.New("usage: buzzpg migrate force VERSION")
		}
		v, err := strconv.Atoi(args[1])
		if err != nil {
			return err
		}
		m, err := db.NewMigrator(url, log)
		if err != nil {
			return err
		}
		defer m.Close()
		return m.Force(v)
	}
	return fmt.Errorf("unknown migrate command %q", args[0])
}
