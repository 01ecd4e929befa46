#!/usr/bin/env bash
# GPU check of the runtime, first part first: does it work, and is it accurate. These are the `gpu`-marked
# tests (tests/runtime/test_gpu_runtime.py: each installed attention backend's ring and LSE kernels at head dim
# 64 and 128 with all-length-1 shards under GQA, auto's choice on bf16 CUDA tensors, bf16 accuracy of every
# backend and comm mode against float64, one bf16 training step under torch.cuda.set_sync_debug_mode("warn");
# tests/runtime/test_kernels_gpu.py: cp_attention of every backend against float64). Then the measurement
# (scripts/gpu_check.py): one rank's attention forward+backward time per strategy at C=131072, cp 8, H=32,
# H_kv=8, D=128. Needs the repo, torch and pytest; at most 8 minutes on an H200. The reports go to stdout and,
# with OUT set, to $OUT/gpu_tests.txt, $OUT/gpu_check.txt and $OUT/gpu_check.json. Extra arguments go to the
# timing script (e.g. --seqs 1, --budget 100). Exits non-zero when a test failed or the timing did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=()
tests_log=/dev/null
if [[ -n "${OUT:-}" ]]; then
    out=(--out "$OUT")
    mkdir -p "$OUT"
    tests_log="$OUT/gpu_tests.txt"
fi
timeout 240 python -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gpu_runtime.py \
    tests/runtime/test_kernels_gpu.py 2>&1 | tee "$tests_log"
tests=$?
timeout 230 python scripts/gpu_check.py ${out[@]+"${out[@]}"} "$@"
timed=$?
exit $(( tests != 0 || timed != 0 ))
