#!/usr/bin/env bash
# GPU check of the runtime (see bench/gpu_check.py): bf16 kernel accuracy against float64, then one rank's
# attention forward+backward time per strategy at C=131072, cp 8, H=32, H_kv=8, D=128. Needs the repo and
# torch only; about 1-3 minutes on an H200. Extra arguments go to the script (e.g. --seqs 1, --budget 100).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 230 python bench/gpu_check.py "$@"
