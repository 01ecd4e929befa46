#!/usr/bin/env bash
# GPU check of the runtime, first part first: does it work, and is it accurate. These are the `gpu`-marked
# tests (tests/runtime/test_gpu_runtime.py: each installed attention backend's ring and LSE kernels at head dim
# 64 and 128 with all-length-1 shards under GQA, auto's choice on bf16 CUDA tensors, bf16 accuracy of every
# backend and comm mode against float64, one bf16 training step under torch.cuda.set_sync_debug_mode("warn");
# tests/runtime/test_kernels_gpu.py: cp_attention of every backend against float64, full attention and the layer
# kinds (window, chunk, window + sinks, window + soft-cap) over their per-kind exchange;
# tests/runtime/test_recurrent_gpu.py: the recurrent libraries flashcp calls, fla's gated delta rule and
# mamba_ssm's SSD with segments, start states and the transition-map call, and their convolutions, in bf16
# against float64, each skipped where it is not installed: pip install 'flashcp[linear]'). Then the measurement
# (scripts/gpu_check.py): one rank's attention forward+backward time per strategy at C=131072, cp 8, H=32,
# H_kv=8, D=128. Then torchtitan's Trainer with flashcp (below). Needs the repo, torch and pytest; at most 11
# minutes on an H200. The reports go to stdout and, with OUT set, to $OUT/gpu_tests.txt, $OUT/gpu_check.txt and
# $OUT/gpu_check.json. Extra arguments go to the timing script (e.g. --seqs 1, --budget 100). Exits non-zero
# when a test failed, the timing did not run or the torchtitan run failed.
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
    tests/runtime/test_kernels_gpu.py tests/runtime/test_recurrent_gpu.py 2>&1 | tee "$tests_log"
tests=$?
timeout 230 python scripts/gpu_check.py ${out[@]+"${out[@]}"} "$@"
timed=$?
# torchtitan's own Trainer with flashcp CP (examples/torchtitan_flashcp.py, config `tiny`: Llama3 debugmodel,
# 2048-token WLB-like sequences, 4 steps), CP over every visible GPU: what its CPU tests cannot run
# (Trainer.__init__ on CUDA, NCCL meshes, MetricsProcessor, the flashcp kernels under torchtitan's loop).
# Skipped without torchtitan; its log goes to $OUT/gpu_torchtitan.txt.
titan=0
if python -c "import torchtitan" 2>/dev/null; then
    titan_dir=$(mktemp -d)
    titan_log=/dev/null
    [[ -n "${OUT:-}" ]] && titan_log="$OUT/gpu_torchtitan.txt"
    ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
    { python -m flashcp synth "$titan_dir/data" --dist wlb --num-seqs 8 --context-len 2048 --vocab-size 2048 &&
      python -m flashcp plan "$titan_dir/data" --cp "$ngpu" &&
      timeout 200 torchrun --nproc-per-node "$ngpu" -m torchtitan.train --module examples.torchtitan_flashcp \
        --config tiny --dataloader.data_dir "$titan_dir/data" --dataloader.plan "cp$ngpu-flashcp2" \
        --parallelism.context_parallel_degree "$ngpu" --dump_folder "$titan_dir/outputs"; } 2>&1 | tee "$titan_log"
    titan=${PIPESTATUS[0]}
    rm -rf "$titan_dir"
fi
exit $(( tests != 0 || timed != 0 || titan != 0 ))
