#!/usr/bin/env bash
# Private PostgreSQL cluster for buzzpg development and tests.
#   scripts/pg.sh start   init (once) and start the cluster, create the database; prints nothing on success
#   scripts/pg.sh stop    stop it
#   scripts/pg.sh url     print the DATABASE_URL of the private cluster (the superuser, who owns the schema)
#   scripts/pg.sh relay-role  create the relay's login role (after migrations made buzz_relay)
#   scripts/pg.sh relay-url   print the URL `make run` serves with: that login role's
#   scripts/pg.sh restart immediate restart (used by crash tests)
# The cluster lives under .data/pg (or, when the checkout is not reachable by the postgres OS user,
# under /var/tmp/buzzpg-<hash>, linked from .data/pg). It listens on 127.0.0.1 only, trust auth.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT=${BUZZ_PGPORT:-54329}
DB=${BUZZ_PGDATABASE:-buzzpg}
# BUZZ_PGDATA puts a second cluster elsewhere (the chaos soak restarts its own PostgreSQL).
DATA_LINK="${BUZZ_PGDATA:-$ROOT/.data/pg}"

find_bindir() {
  if [ -n "${PG_BINDIR:-}" ] && [ -x "$PG_BINDIR/postgres" ]; then echo "$PG_BINDIR"; return; fi
  # The newest installed major version (Debian installs each under /usr/lib/postgresql/<major>).
  local v
  v=$(ls -d /usr/lib/postgresql/*/bin/postgres 2>/dev/null | sed 's|/usr/lib/postgresql/\([0-9]*\)/.*|\1|' | sort -n | tail -1)
  if [ -n "$v" ]; then echo "/usr/lib/postgresql/$v/bin"; return; fi
  if command -v pg_ctl >/dev/null 2>&1; then dirname "$(command -v pg_ctl)"; return; fi
  return 1
}

ensure_binaries() {
  if ! find_bindir >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "pg.sh: no PostgreSQL server binaries found; installing Debian's postgresql package" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; }
    else
      echo "pg.sh: no PostgreSQL server binaries found; install PostgreSQL 14+ (Debian: apt-get install postgresql) or set PG_BINDIR" >&2
      exit 1
    fi
  fi
}

# as_pg runs a command as the unprivileged cluster owner when we are root (initdb refuses root).
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

datadir() {
  local parent; parent=$(dirname "$DATA_LINK")
  mkdir -p "$parent"
  if [ -L "$DATA_LINK" ] || [ -d "$DATA_LINK" ]; then readlink -f "$DATA_LINK"; return; fi
  local dir="$DATA_LINK"
  if [ "$(id -u)" = 0 ] && ! runuser -u postgres -- test -x "$parent" 2>/dev/null; then
    # The checkout is not traversable by the postgres user (e.g. under a 0700 temp dir): keep the
    # cluster in a world-traversable place and link it.
    local h; h=$(printf '%s' "$DATA_LINK" | sha1sum | cut -c1-12)
    dir="/var/tmp/buzzpg-$h/pg"
    mkdir -p "$dir"; chown -R postgres: "/var/tmp/buzzpg-$h"
    ln -sfn "$dir" "$DATA_LINK"
  else
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
  fi
  echo "$dir"
}

url() { echo "postgres://postgres@127.0.0.1:$PORT/$DB?sslmode=disable"; }

# The relay runs as a deployment runs it: a login member of buzz_relay with REPLICATION (for its
# slot and stream), not a superuser. internal/testenv makes the same role for tests.
RELAY_LOGIN=buzz_relay_login
relay_url() { echo "postgres://$RELAY_LOGIN@127.0.0.1:$PORT/$DB?sslmode=disable"; }

relay_role() {
  local bin; bin=$(find_bindir)
  as_pg "$bin/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -qtAX -v ON_ERROR_STOP=1 -c "DO \$\$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '$RELAY_LOGIN') THEN
      CREATE ROLE $RELAY_LOGIN LOGIN REPLICATION IN ROLE buzz_relay;
    END IF; END \$\$"
}

start() {
  ensure_binaries
  local bin dir; bin=$(find_bindir); dir=$(datadir)
  if [ ! -f "$dir/PG_VERSION" ]; then
    as_pg "$bin/initdb" -D "$dir" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir.initdb.log" 2>&1 \
      || { cat "$dir.initdb.log" >&2; exit 1; }
    cat >>"$dir/postgresql.conf" <<CONF
# buzzpg private cluster
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$dir'
wal_level = logical
max_wal_senders = 64
max_replication_slots = 64
max_connections = 400
max_slot_wal_keep_size = '2GB'
idle_in_transaction_session_timeout = '60s'
wal_sender_timeout = '30s'
wal_writer_delay = '10ms'
shared_buffers = '256MB'
logging_collector = off
log_min_messages = warning
CONF
  fi
  if ! as_pg "$bin/pg_ctl" -D "$dir" status >/dev/null 2>&1; then
    as_pg "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 start >/dev/null \
      || { tail -20 "$dir/server.log" >&2; exit 1; }
  fi
  if ! as_pg "$bin/psql" -h 127.0.0.1 -p "$PORT" -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname='$DB'" | grep -q 1; then
    as_pg "$bin/createdb" -h 127.0.0.1 -p "$PORT" -U postgres "$DB"
  fi
}

stop() {
  local bin dir; bin=$(find_bindir) || exit 0
  [ -e "$DATA_LINK" ] || exit 0
  dir=$(readlink -f "$DATA_LINK")
  as_pg "$bin/pg_ctl" -D "$dir" -m fast -w stop >/dev/null 2>&1 || true
}

restart_immediate() {
  local bin dir; bin=$(find_bindir); dir=$(readlink -f "$DATA_LINK")
  as_pg "$bin/pg_ctl" -D "$dir" -m immediate -w stop >/dev/null 2>&1 || true
  as_pg "$bin/pg_ctl" -D "$dir" -l "$dir/server.log" -w -t 60 start >/dev/null
}

# Drop databases earlier test runs left behind (and their replication slots): the one drop helper
# is Go's (internal/db DropDatabase), shared with the tests and the load tool.
dropdbs() {
  cd "$ROOT" && "${GO:-go}" run ./scripts/dropdbs "$(url)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) url ;;
  relay-url) relay_url ;;
  relay-role) relay_role ;;
  restart) restart_immediate ;;
  datadir) datadir ;;
  dropdbs) dropdbs ;;
  bindir) find_bindir ;;
  *) echo "usage: $0 start|stop|restart|url|relay-url|relay-role|datadir|bindir|dropdbs" >&2; exit 2 ;;
esac
