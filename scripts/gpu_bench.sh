#!/usr/bin/env bash
# flashcp bench on one GPU, in one short run (about 2-3 minutes on an H200; no flash-attn needed):
#   1. --calibrate: time the attention kernel (torch_varlen, or flash_attn when installed) at 128..32K tokens,
#      forward and backward, plus one call's overhead and the copy bandwidth -> bench/out/profile-gpu.json;
#   2. --measured: the latency scenario (paper Figures 5-7) with every rank's attention timed on the GPU,
#      one rank after another, for one sequence per setting; communication stays projected from the
#      profile's link bandwidth (one GPU cannot measure NVLink).
# Outputs: bench/out/gpu-bench.json (every number), bench/out/gpu-bench.png, the tables on stdout.
# Extra arguments go to `flashcp bench` (e.g. --dist wlb to shorten it, --measure-budget 60).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p bench/out
exec timeout 300 python -m flashcp bench --calibrate --profile-out bench/out/profile-gpu.json --measured --quick \
    --dist wlb,pile --measure-budget 100 --json bench/out/gpu-bench.json --plot bench/out/gpu-bench.png "$@"
