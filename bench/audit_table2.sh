#!/usr/bin/env bash
# The paper's Table 2: CP-SAT's exact sharding (at a block granularity) against the flashcp heuristic.
# Usage: bench/audit_table2.sh [OUT_DIR]   (env: CPS="4 8", DISTS="pile wlb", SAMPLES=20, TIME_LIMIT=20,
#                                           GRANULARITY=1024, WORKERS=0, SEQS=200, CONTEXT_LEN=131072)
# Writes OUT_DIR/<dist>-cp<N>.json (per-sequence results) and prints one table per (dist, cp).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/flashcp-table2}
CPS=${CPS:-"4 8"}
DISTS=${DISTS:-"pile wlb"}
mkdir -p "$OUT"
for dist in $DISTS; do
  data="$OUT/$dist"
  [ -f "$data/manifest.json" ] || python -m flashcp synth "$data" --dist "$dist" --num-seqs "${SEQS:-200}" \
      --context-len "${CONTEXT_LEN:-131072}" --seed 0 --no-tokens
  for cp in $CPS; do
    [ -f "$data/plans/cp$cp-flashcp/plan.json" ] || python -m flashcp plan "$data" --cp "$cp" --strategy flashcp
    echo "== $dist, cp $cp =="
    python -m flashcp audit "$data" --plan "cp$cp-flashcp" --ilp --samples "${SAMPLES:-20}" --seed 0 \
        --time-limit "${TIME_LIMIT:-20}" --granularity "${GRANULARITY:-1024}" --workers "${WORKERS:-0}" \
        --json "$OUT/$dist-cp$cp.json"
  done
done
