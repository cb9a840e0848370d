#!/usr/bin/env bash
# The purge bar of docs/benchmarks.md (Upkeep): a relay taking RATE kind 1 events/s while upkeep
# purges ROWS expired events, against the same run with nothing old enough to purge.
#
#   scripts/bench-purge.sh [ROWS] [ROUNDS]     (make bench-purge; defaults 1000000 and 2)
#
# Builds one template database with ROWS events expired an hour ago, then per round runs "off" and
# "on" (order alternating by round) on a file copy of it: `buzzpg bench ingest --spawn 1` at RATE/s
# for DURATION, upkeep every second with grace 0 (on) or ten years (off). Prints the relay row's
# OK latency of every run, the purged rows and the ratio of the medians of the p99s.
# Env: BUZZ_BIN (default bin/buzzpg), RATE (500), DURATION (300s), CONNS (32), OUT (a temp dir).
set -euo pipefail
rows=${1:-1000000}; rounds=${2:-2}
bin=${BUZZ_BIN:-bin/buzzpg}; rate=${RATE:-500}; dur=${DURATION:-300s}; conns=${CONNS:-32}
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"
url=$(scripts/pg.sh url)
base=${url%/*}
tpl=buzz_purge_tpl

sql() { PGOPTIONS="-c client_min_messages=warning" psql "$1" -qtAX -v ON_ERROR_STOP=1 -c "$2"; }

make_template() {
  sql "$url" "DROP DATABASE IF EXISTS $tpl" >/dev/null
  sql "$url" "CREATE DATABASE $tpl" >/dev/null
  DATABASE_URL="$base/$tpl?sslmode=disable" "$bin" migrate up >/dev/null 2>&1
  # Rows as accept_event would store an expired kind 1 (no signature check: they never reach a client).
  sql "$base/$tpl" "INSERT INTO buzz.events (id, pubkey, created_at, kind, tags, content, sig, expires_at)
    SELECT lpad(to_hex(i), 64, '0'), repeat('ab', 32), extract(epoch FROM now())::bigint - 7200 + i % 3600, 1,
           jsonb_build_array(jsonb_build_array('expiration', (extract(epoch FROM now())::bigint - 3600)::text)),
           'expired ' || i, repeat('0', 128), extract(epoch FROM now())::bigint - 3600
    FROM generate_series(1, $rows) AS i" >/dev/null
  sql "$base/$tpl" "VACUUM ANALYZE buzz.events" >/dev/null
}

# run MODE ROUND: one ingest run on a fresh copy of the template; prints "mode round rate p50 p99 purged".
run() {
  local mode=$1 n=$2 db=buzz_purge_run grace
  [ "$mode" = on ] && grace=0s || grace=87600h
  sql "$url" "DROP DATABASE IF EXISTS $db" >/dev/null
  sql "$url" "CREATE DATABASE $db TEMPLATE $tpl STRATEGY FILE_COPY" >/dev/null
  sql "$url" "CHECKPOINT" >/dev/null
  BUZZ_UPKEEP_INTERVAL=1s BUZZ_UPKEEP_GRACE=$grace "$bin" bench ingest --spawn 1 --quiet --no-baseline \
    --database-url "$base/$db?sslmode=disable" --rate "$rate" --duration "$dur" --conns "$conns" \
    --n $(( ${rate%.*} * ${dur%s} )) --json "$out/$mode-$n.json" >"$out/$mode-$n.log" 2>&1
  local left
  left=$(sql "$base/$db" "SELECT count(*) FROM buzz.events WHERE expires_at IS NOT NULL")
  sql "$url" "DROP DATABASE $db" >/dev/null
  python3 - "$out/$mode-$n.json" "$mode" "$n" "$((rows - left))" <<'EOF'
import json, sys
res = json.load(open(sys.argv[1]))
res = res[0] if isinstance(res, list) else res
row = next(r for r in res['rows'] if not r.get('baseline'))
print(sys.argv[2], sys.argv[3], f"{row['rate_per_s']:.1f}", f"{row['latency']['p50_ms']:.1f}", f"{row['latency']['p99_ms']:.1f}", sys.argv[4])
EOF
}

echo "building a template of $rows expired events"
make_template
echo "mode round rate/s p50_ms p99_ms purged" | tee "$out/table.txt"
for n in $(seq 1 "$rounds"); do
  if [ $((n % 2)) = 1 ]; then order="off on"; else order="on off"; fi
  for m in $order; do run "$m" "$n" | tee -a "$out/table.txt"; done
done
sql "$url" "DROP DATABASE $tpl" >/dev/null
python3 - "$out/table.txt" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()[1:]]
p99 = {m: statistics.median(float(r[4]) for r in rows if r[0] == m) for m in ('off', 'on')}
print(f"median OK p99: off {p99['off']:.1f} ms, on {p99['on']:.1f} ms, on/off {p99['on'] / p99['off']:.2f} (bar: < 1.20)")
EOF
echo "results in $out"
