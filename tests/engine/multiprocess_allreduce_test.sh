#!/usr/bin/env bash
# Multi-process all-reduce over loopback Gloo TCP: n separate dynamiq-bench processes per run.
# Checks that every rank ends with bit-identical results (same output checksum), that `none` is
# exact up to fp32 summation order and dynamiq's error is in its expected range, for ring with
# n = 1, 2, 3, 5 and butterfly with n = 4; and that butterfly with n = 3 is rejected clearly.
# Usage: multiprocess_allreduce_test.sh path/to/dynamiq-bench
set -euo pipefail
BENCH=${1:?usage: $0 path/to/dynamiq-bench}
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

# Below Linux's ephemeral range (32768-60999), where other tests' listeners on port 0 land.
port() { echo $((20000 + (RANDOM % 12000))); }

run() {  # run <n> <codec> <bits> <topology> -> writes $WORK/out.<r>
  local n=$1 codec=$2 bits=$3 topo=$4 p
  p=$(port)
  local pids=()
  for ((r = 0; r < n; r++)); do
    local serve=""
    [[ $r -eq 0 ]] && serve="--serve_store"
    timeout 120 "$BENCH" allreduce --rank=$r --world_size=$n --store=127.0.0.1:$p $serve \
      --codec=$codec --bits=$bits --topology=$topo --size=70000 --iterations=1 --warmup=0 \
      --block=16384 --timeout=30 --all_ranks_print >"$WORK/out.$r" 2>"$WORK/err.$r" &
    pids+=($!)
  done
  local rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}

field() { sed -n "s/.*\"$2\":\"\\{0,1\\}\\([^,\"}]*\\).*/\\1/p" "$WORK/out.$1"; }

check() {  # check <n> <codec> <bits> <topology> <max_vnmse>
  local n=$1 codec=$2 bits=$3 topo=$4 max=$5
  local attempt ok=0
  for attempt in 1 2 3; do  # another process may hold the random store port: take another
    if run "$n" "$codec" "$bits" "$topo"; then ok=1; break; fi
    grep -q "Address already in use" "$WORK/err.0" || break
  done
  if ((!ok)); then
    echo "FAIL: $codec $topo n=$n did not complete"; tail -n 5 "$WORK"/err.*; exit 1
  fi
  local sum0 v
  sum0=$(field 0 output_checksum)
  for ((r = 1; r < n; r++)); do
    [[ "$(field $r output_checksum)" == "$sum0" ]] || { echo "FAIL: $codec $topo n=$n rank $r differs"; exit 1; }
  done
  v=$(field 0 vnmse)
  awk -v v="$v" -v m="$max" 'BEGIN { exit !(v <= m) }' || { echo "FAIL: $codec $topo n=$n vnmse $v > $max"; exit 1; }
  echo "ok: $codec $topo n=$n vnmse=$v checksum=$sum0"
}

for n in 1 2 3 5; do
  check $n none 0 ring 1e-12
  check $n dynamiq 5 ring 5e-3
done
check 4 dynamiq 5 butterfly 5e-3
check 4 mxfp8 0 ring 1e-2

# Butterfly needs a power of two: every rank must say so and exit non-zero.
if run 3 dynamiq 5 butterfly; then echo "FAIL: butterfly with 3 ranks ran"; exit 1; fi
grep -q "power-of-two" "$WORK/err.0" || { echo "FAIL: no clear butterfly error"; cat "$WORK/err.0"; exit 1; }
echo "ok: butterfly n=3 rejected: $(head -c 200 "$WORK/err.0")"

# A peer killed mid-collective: the survivors fail within their timeout (not hang), naming a rank.
p=$(port)
pids=()
for ((r = 0; r < 3; r++)); do
  serve=""
  [[ $r -eq 0 ]] && serve="--serve_store"
  timeout 60 "$BENCH" allreduce --rank=$r --world_size=3 --store=127.0.0.1:$p $serve --codec=dynamiq \
    --size=2000000 --iterations=200 --warmup=0 --timeout=5 >"$WORK/kill.$r" 2>&1 &
  pids+=($!)
done
sleep 2
pkill -9 -P "${pids[1]}"  # the bench process (its parent is `timeout`)
start=$SECONDS
for r in 0 2; do
  if wait "${pids[$r]}"; then echo "FAIL: rank $r succeeded although rank 1 was killed"; exit 1; fi
done
wait "${pids[1]}" 2>/dev/null || true
elapsed=$((SECONDS - start))
[[ $elapsed -le 20 ]] || { echo "FAIL: survivors took ${elapsed}s to fail"; exit 1; }
grep -q "rank" "$WORK/kill.0" || { echo "FAIL: no rank named"; cat "$WORK/kill.0"; exit 1; }
echo "ok: killed rank 1; survivors failed in ${elapsed}s: $(head -c 200 "$WORK/kill.0")"
