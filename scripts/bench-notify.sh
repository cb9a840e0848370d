#!/usr/bin/env bash
# What the outbox NOTIFY costs acceptance, isolated: no relay, no listener, no publication.
#
#   scripts/bench-notify.sh [clients ...]      (default: 2 8 16; BENCH_SECONDS per run, default 8)
#
# Each pgbench transaction pair is one hide/resurface cycle of a random viewer out of 2,000 DM
# channels: buzz.hide_dm, then buzz.accept_event of a message that resurfaces the DM. Both bump the
# viewer's generation and upsert its outbox row, so both commit with the trigger's NOTIFY. The same
# cycles run with the trigger enabled and disabled, alternating, in a fresh database on the server
# of DATABASE_URL (default: the private cluster), which is dropped afterwards. Nothing drains the
# outbox (it holds at most one row per viewer), so the difference is the NOTIFY alone.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BUZZ_BIN:-$ROOT/bin/buzzpg}
SECS=${BENCH_SECONDS:-8}
[ $# -gt 0 ] || set -- 2 8 16
PGBIN=$("$ROOT/scripts/pg.sh" bindir)
BASE=${DATABASE_URL:-$("$ROOT/scripts/pg.sh" url)}
DB="buzz_notify_$$"
# Swap the database name in the URL's path (postgres://user@host:port/NAME?params).
URL=$(printf '%s' "$BASE" | sed -E "s#^([a-z]+://[^/]*/)[^?]*#\1$DB#")
ADMIN=$(printf '%s' "$BASE" | sed -E "s#^([a-z]+://[^/]*/)[^?]*#\1postgres#")
psql() { "$PGBIN/psql" -X -v ON_ERROR_STOP=1 -qAt "$@"; }

psql "$ADMIN" -c "CREATE DATABASE $DB"
trap 'psql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null' EXIT
[ -x "$BIN" ] || { echo "bench-notify: $BIN not built (make build)" >&2; exit 1; }
DATABASE_URL="$URL" "$BIN" migrate up >/dev/null 2>&1
psql "$URL" <<'SQL'
INSERT INTO buzz.config (key, value) VALUES ('relay_pubkey', repeat('ab', 32))
  ON CONFLICT (key) DO UPDATE SET value = excluded.value;
CREATE TABLE bench_viewers (i int PRIMARY KEY, viewer text NOT NULL, ch uuid NOT NULL);
INSERT INTO bench_viewers
SELECT i, v, (buzz.open_dm(repeat('cd', 32), ARRAY[v], NULL)).channel_id
  FROM generate_series(1, 2000) i, LATERAL (SELECT md5(i::text) || md5((i + 100000)::text) AS v) x;
SQL
SCRIPT=$(mktemp)
cat >"$SCRIPT" <<'EOF'
\set i random(1, 2000)
SELECT buzz.hide_dm(viewer, ch) FROM bench_viewers WHERE i = :i;
SELECT ok FROM bench_viewers, buzz.accept_event(jsonb_build_object(
  'id', md5(random()::text) || md5(random()::text), 'pubkey', repeat('cd', 32),
  'created_at', extract(epoch FROM now())::bigint, 'kind', 9,
  'tags', jsonb_build_array(jsonb_build_array('h', ch::text)), 'content', 'ping',
  'sig', repeat('ef', 64))) WHERE i = :i;
EOF
trap 'rm -f "$SCRIPT"; psql "$ADMIN" -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null' EXIT

run() { # clients -> cycles/s
  "$PGBIN/pgbench" -n -M prepared -c "$1" -j 2 -T "$SECS" -f "$SCRIPT" "$URL" 2>&1 |
    sed -nE 's/^tps = ([0-9.]+) .*/\1/p'
}
printf '%-8s %-22s %-22s %s\n' clients "with NOTIFY cycles/s" "without cycles/s" ratio
for c in "$@"; do
  for round in 1 2; do
    psql "$URL" -c "ALTER TABLE buzz.visibility_outbox ENABLE TRIGGER visibility_outbox_notify"
    with=$(run "$c")
    psql "$URL" -c "ALTER TABLE buzz.visibility_outbox DISABLE TRIGGER visibility_outbox_notify"
    without=$(run "$c")
    awk -v c="$c" -v w="$with" -v wo="$without" 'BEGIN { printf "%-8s %-22.0f %-22.0f %.2f\n", c, w, wo, w / wo }'
  done
done
