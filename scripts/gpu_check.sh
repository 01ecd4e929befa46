#!/usr/bin/env bash
# GPU check of the runtime (see scripts/gpu_check.py), first section first: does it work (each installed
# attention backend's import, auto's choice on bf16 CUDA tensors, the ring's backward through every
# available backend, LSE shapes at head dim 64 and 128 with all-length-1 shards under GQA, one bf16 training
# step under torch.cuda.set_sync_debug_mode("warn")); then bf16 accuracy against float64; then one rank's
# attention forward+backward time per strategy at C=131072, cp 8, H=32, H_kv=8, D=128. Needs the repo and
# torch only; at most 8 minutes on an H200. The report goes to stdout and, with OUT set, to
# $OUT/gpu_check.txt and $OUT/gpu_check.json. Extra arguments go to the script (e.g. --seqs 1, --budget 100).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=()
if [[ -n "${OUT:-}" ]]; then out=(--out "$OUT"); fi
exec timeout 470 python scripts/gpu_check.py ${out[@]+"${out[@]}"} "$@"
