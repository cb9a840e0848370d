package main

import (
	"context"
	"log/slog"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/buzzpg/buzzpg/internal/testenv"
)

// Every pool is closed, all at once. Run under -race (`make test` does, for this package's
// Race tests): the closes end while the set is still being walked, which is where a map written
// outside its lock once raced with them.
func TestRacePoolSetCloseClosesEveryPool(t *testing.T) {
	url := testenv.FreshDB(t)
	var s poolSet
	names := []string{"accept", "listener", "fanout", "reader", "auth", "admin"}
	for _, n := range names {
		p, err := pgxpool.New(context.Background(), url)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Ping(context.Background()); err != nil {
			t.Fatal(err)
		}
		s.add(n, p)
	}
	s.close(slog.New(slog.DiscardHandler))
	for i, p := range s.pools {
		if _, err := p.Acquire(context.Background()); err == nil {
			t.Errorf("pool %s still hands out connections after close", names[i])
		}
	}
}
