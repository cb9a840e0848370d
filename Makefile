# buzzpg: `make run` serves a relay on ws://127.0.0.1:7777 (metrics on 127.0.0.1:7778); `make test` runs every test.
# Both start (or reuse) a private PostgreSQL cluster under .data/pg with wal_level=logical, where
# the superuser owns the schema and runs migrations and relays run as the login role
# buzz_relay_login (a member of buzz_relay with REPLICATION), as in a deployment.
# DATABASE_URL points them at an existing server instead (make run then serves as its role).

SHELL := /bin/bash
GO ?= go
# Verify signatures with libsecp256k1 (cgo) when its headers are installed and cgo works (Go turns
# it off without a C compiler, and go-nostr's libsecp256k1 build has no pure-Go fallback); pure Go otherwise.
SECP := $(shell test -f /usr/include/secp256k1.h && [ "$$($(GO) env CGO_ENABLED 2>/dev/null)" = 1 ] && echo libsecp256k1)
TAGS ?= $(SECP)
TEST_TAGS ?= $(strip $(SECP) testhooks)
BIN := bin/buzzpg
TEST_BIN := bin/buzzpg-test
LISTEN ?= 127.0.0.1:7777
PRIVATE_URL = $(shell scripts/pg.sh url)
DB_URL = $(if $(DATABASE_URL),$(DATABASE_URL),$(PRIVATE_URL))
RUN_URL = $(if $(DATABASE_URL),$(DATABASE_URL),$(shell scripts/pg.sh relay-url))
TEST_TIMEOUT ?= 14m
# A count, not a duration: Go 1.26's fuzz coordinator can report a spurious "context deadline
# exceeded" when a -fuzztime duration expires under CPU contention (go.dev/issue/75804, fixed in
# Go 1.27); seen here once in make test. 15,000 inputs take 3-6 s per target on this machine.
FUZZTIME ?= 15000x

.PHONY: all build run test race fuzz bench bench-go bench-notify bench-purge chaos chaos-long soak-upkeep psql db-start db-stop clean vet

all: build

$(BIN) build:
	$(if $(SECP),,@echo "make: no libsecp256k1 headers or no cgo: signatures checked in pure Go, about 3x the relay's CPU per event (apt-get install libsecp256k1-dev gcc)" >&2)
	$(GO) build -tags '$(TAGS)' -o $(BIN) ./cmd/buzzpg

$(TEST_BIN): FORCE
	$(GO) build -tags '$(TEST_TAGS)' -o $(TEST_BIN) ./cmd/buzzpg
FORCE:

db-start:
	@if [ -z "$(DATABASE_URL)" ]; then scripts/pg.sh start; fi

db-stop:
	scripts/pg.sh stop

psql: db-start
	psql "$(DB_URL)"

.data/relay.key: build
	@mkdir -p .data
	$(BIN) keygen --out .data/relay.key

# On the private cluster the owner migrates first: the relay's role may not.
run: db-start build .data/relay.key
	$(if $(DATABASE_URL),,DATABASE_URL="$(PRIVATE_URL)" $(BIN) migrate up && scripts/pg.sh relay-role)
	DATABASE_URL="$(RUN_URL)" BUZZ_LISTEN="$${BUZZ_LISTEN:-$(LISTEN)}" BUZZ_METRICS_LISTEN="$${BUZZ_METRICS_LISTEN-127.0.0.1:7778}" \
	  BUZZ_AUTO_MIGRATE="$${BUZZ_AUTO_MIGRATE:-$(if $(DATABASE_URL),true,false)}" \
	  BUZZ_RELAY_KEY_FILE="$${BUZZ_RELAY_KEY_FILE:-.data/relay.key}" $(BIN) serve

# Tests create their own databases (cloned from a migrated template) on the same server, and start
# relays as buzz_relay_login (internal/testenv).
test: db-start $(TEST_BIN)
	@scripts/pg.sh dropdbs >/dev/null 2>&1 || true
	BUZZ_BIN=$(CURDIR)/$(TEST_BIN) BUZZ_BUILD_TAGS='$(TEST_TAGS)' $(if $(DATABASE_URL),,BUZZ_OWNS_SERVER=1) \
	  $(GO) test -tags '$(TEST_TAGS)' -count=1 -p 2 -timeout $(TEST_TIMEOUT) ./...
	$(MAKE) --no-print-directory race fuzz

# Tests named TestRace* exist to be run under the race detector (they pass without it).
race: db-start
	BUZZ_BIN=$(CURDIR)/$(TEST_BIN) BUZZ_BUILD_TAGS='$(TEST_TAGS)' $(if $(DATABASE_URL),,BUZZ_OWNS_SERVER=1) \
	  $(GO) test -race -tags '$(TEST_TAGS)' -count=1 -run '^TestRace' ./cmd/buzzpg/


# Each fuzz target for FUZZTIME inputs (the committed corpus also runs as plain tests).
fuzz:
	@for t in $$($(GO) test -list 'Fuzz.*' ./relay/ | grep ^Fuzz); do \
	  echo "fuzz $$t ($(FUZZTIME))"; \
	  $(GO) test -tags '$(TAGS)' -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) ./relay/ || exit 1; \
	done

vet:
	$(GO) vet -tags '$(TEST_TAGS)' ./...

clean:
	rm -rf bin

# Load tool: a fresh database on the private cluster, two `buzzpg serve` processes of bin/buzzpg
# (flood starts two more, with and without rate limits), the standard scenario set: ingest, dm
# (hot, mix, resurface; 16 conns), converge, reminders, fanout, flood (about 5 minutes); tables on
# stdout, JSON in $(BENCH_JSON).
BENCH_JSON ?= bin/bench-results.json
bench: db-start build
	$(BIN) bench standard --spawn 2 --fresh --database-url "$(DB_URL)" --json $(BENCH_JSON)

# Upkeep soak (issue 31; not part of make test): SOAK_DURATION of DM traffic with hides and
# resurfacing, reminders armed and firing, and events expiring within a minute, at SOAK_RATE events/s
# through two relays on a fresh database, which purge every 15 s (grace 30 s, settled reminders
# kept 1 min). Prints hot table and index sizes and slot WAL every minute; fails unless the hot
# tables grow by less than 10% after the warm-up (a third of the run, at most 5 min), no expired
# event outlives grace + one interval, and a slot retains less than 64 MB of WAL.
SOAK_DURATION ?= 20m
SOAK_RATE ?= 100
soak-upkeep: db-start build
	BUZZ_UPKEEP_INTERVAL=15s BUZZ_UPKEEP_GRACE=30s BUZZ_UPKEEP_REMINDER_KEEP=1m \
	  $(BIN) bench soak --spawn 2 --fresh --database-url "$(DB_URL)" --duration $(SOAK_DURATION) --rate $(SOAK_RATE) --conns 4

# The purge bar (docs/benchmarks.md, Upkeep): OK p99 at 500 events/s while upkeep purges
# PURGE_ROWS expired events, against the same run without a purge; PURGE_ROUNDS pairs, 5 minutes a run.
PURGE_ROWS ?= 1000000
PURGE_ROUNDS ?= 2
bench-purge: db-start build
	BUZZ_BIN=$(CURDIR)/$(BIN) scripts/bench-purge.sh $(PURGE_ROWS) $(PURGE_ROUNDS)

# What the outbox NOTIFY costs acceptance, isolated (pgbench, no relay, no listener): hide and
# resurface cycles with the trigger enabled and disabled, for NOTIFY_CLIENTS connections each.
NOTIFY_CLIENTS ?= 2 8 16
bench-notify: db-start build
	BUZZ_BIN=$(CURDIR)/$(BIN) scripts/bench-notify.sh $(NOTIFY_CLIENTS)

# Chaos soak on its own second PostgreSQL cluster: CHAOS_DURATION (default 5m) of faults, one every
# CHAOS_FAULT_EVERY on average (default: the duration / 12, at most 10s), then the checker.
# CHAOS_SEED=<n> replays a schedule; CHAOS_KEEP=1 keeps tests/testdata/chaos-*/ logs.
# chaos-long: 25 minutes, a fault every 6 s (about 150 crashes, 35 freezes, 35 cuts, 12 PostgreSQL
# restarts, 2 slot invalidations); not part of make test.
CHAOS_DURATION ?= 5m
CHAOS_TIMEOUT ?= 60m
CHAOS_RUN = BUZZ_BIN=$(CURDIR)/$(TEST_BIN) BUZZ_BUILD_TAGS='$(TEST_TAGS)' \
	  $(if $(CHAOS_SEED),BUZZ_CHAOS_SEED=$(CHAOS_SEED)) $(if $(CHAOS_KEEP),BUZZ_CHAOS_KEEP=1) \
	  $(GO) test -tags '$(TEST_TAGS)' -count=1 -v -run '^TestChaosSoak$$' -timeout $(CHAOS_TIMEOUT) ./tests/chaos/
chaos: $(TEST_BIN)
	BUZZ_CHAOS_DURATION=$(CHAOS_DURATION) $(if $(CHAOS_FAULT_EVERY),BUZZ_CHAOS_FAULT_EVERY=$(CHAOS_FAULT_EVERY)) $(CHAOS_RUN)
chaos-long: $(TEST_BIN)
	BUZZ_CHAOS_DURATION=25m BUZZ_CHAOS_FAULT_EVERY=$(or $(CHAOS_FAULT_EVERY),6s) $(CHAOS_RUN)

# Every `go test -bench` figure with the sizes the issues ask for (about 10 minutes on a quiet
# 2-core machine). Each benchmark measures its own baseline in the same run and prints the ratio.
# FANOUT_RATES: the fan-out rates, 30 s each, each after its SQL floor at the same rate.
FANOUT_RATES ?= 250,500,1000,2000
BENCH_GO_ENV = BUZZ_BIN=$(CURDIR)/$(TEST_BIN) BUZZ_BUILD_TAGS='$(TEST_TAGS)'
bench-go: db-start $(TEST_BIN)
	$(BENCH_GO_ENV) $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench 'AcceptEvent' -benchtime 5000x ./internal/store/
	$(BENCH_GO_ENV) $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench 'ReqLatency' ./relay/
	$(BENCH_GO_ENV) BUZZ_BENCH_DURATION=30s BUZZ_BENCH_RATES=$(FANOUT_RATES) \
	  $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench 'FanoutCrossProcess' -benchtime 1x -timeout 30m ./tests/
	$(BENCH_GO_ENV) $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench 'Snapshot' -benchtime 1x -timeout 30m ./listener/visibility/ ./tests/
	$(BENCH_GO_ENV) $(GO) test -tags '$(TEST_TAGS)' -run '^$$' -bench 'ReminderLateness' -benchtime 1x -timeout 30m ./listener/reminders/
