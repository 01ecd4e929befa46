#!/usr/bin/env bash
# The paper's Table 2: CP-SAT's exact sharding (at a block granularity) against the flashcp heuristic.
# Usage: scripts/audit_table2.sh [OUT_DIR]
#   env: CPS="4 8" DISTS="pile wlb" SAMPLES=20 TIME_LIMIT=10 GRANULARITY=1024 WORKERS=2 SEQS=100
#        CONTEXT_LEN=131072
# Per (dist, cp): the ILP on the plain block grid; for cp 4 also with the plan's own cuts added to the grid
# (--plan-cuts: never worse than the plan), and the same capped at the plan's own max workload
# (--match-imbalance: comm saving at equal imbalance). Writes OUT_DIR/<dist>-cp<N>[-cuts[-match]].json/.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/flashcp-table2}
# Before any work, every report goes through the output check of the commands (flashcp.outputs): never into a
# dataset, and over a file only when it is an earlier run's (a .txt beside the audit report it was written with).
DISTS=${DISTS:-pile wlb} CPS=${CPS:-4 8} python - "$OUT" <<'CHECK'
import dataclasses
import os
import sys
from pathlib import Path

from flashcp.cli.audit import AUDIT_REPORT
from flashcp.outputs import OutputKind, check_script_output

out, report = Path(sys.argv[1]), dataclasses.replace(AUDIT_REPORT, option="OUT_DIR")
text = OutputKind(what="a scripts/audit_table2.sh report", option="OUT_DIR",
                  recognise=lambda path: report.recognise(path.with_suffix(".json")))
for dist in os.environ["DISTS"].split():
    for cp in os.environ["CPS"].split():
        for tail in ("", "-cuts", "-cuts-match") if cp == "4" else ("",):
            check_script_output(out / f"{dist}-cp{cp}{tail}.json", report)
            check_script_output(out / f"{dist}-cp{cp}{tail}.txt", text)
CHECK
mkdir -p "$OUT"
common=(--ilp --samples "${SAMPLES:-20}" --seed 0 --time-limit "${TIME_LIMIT:-10}"
        --granularity "${GRANULARITY:-1024}" --workers "${WORKERS:-2}")
for dist in ${DISTS:-pile wlb}; do
  data="$OUT/$dist"
  [ -f "$data/manifest.json" ] || python -m flashcp synth "$data" --dist "$dist" --num-seqs "${SEQS:-100}" \
      --context-len "${CONTEXT_LEN:-131072}" --seed 0 --no-tokens
  for cp in ${CPS:-4 8}; do
    [ -f "$data/plans/cp$cp-flashcp/plan.json" ] || python -m flashcp plan "$data" --cp "$cp" --strategy flashcp
    run() {  # run NAME EXTRA_ARGS...
      local name=$1; shift
      python -m flashcp audit "$data" --plan "cp$cp-flashcp" "${common[@]}" "$@" --json "$OUT/$name.json" \
          2>&1 | tee "$OUT/$name.txt"
    }
    run "$dist-cp$cp"
    if [ "$cp" = 4 ]; then
      run "$dist-cp$cp-cuts" --plan-cuts
      run "$dist-cp$cp-cuts-match" --plan-cuts --match-imbalance
    fi
  done
done
