"""Training tokens/s of several plans of one dataset, in one torchrun job, same model and data.

    torchrun --nproc-per-node 2 scripts/train_throughput.py DATA --plans cp2-flashcp,cp2-llama3,cp2-perdoc

For each plan in turn: the same model from the same seed, the same sequences in file order, ``--warmup``
steps untimed and then ``--steps`` timed steps of ``flashcp.train.loop.run_training``. Tokens/s is the
sequences' tokens over the sum of step times (the slowest rank's, data loading included). Ratios are
against the first plan. Since every plan computes the same sums, the losses must agree across plans (the
last column shows how far they differ from the first plan's). On the CPU (gloo, ``reference`` kernels, which
loop over shards) the numbers measure this machine's costs, not a GPU's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp.cli.console import error  # noqa: E402
from flashcp.errors import FlashcpError  # noqa: E402
from flashcp.integrations.models import build_model  # noqa: E402
from flashcp.outputs import check_output, json_report, write_json_output  # noqa: E402
from flashcp.train.launch import torchrun_group  # noqa: E402
from flashcp.train.loop import TrainOptions, run_training  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data")
    parser.add_argument("--plans", required=True, help="comma-separated plan names; ratios against the first")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per plan")
    parser.add_argument("--comm", default="auto")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with torchrun_group() as launch:
        try:
            results = []
            if args.json:
                check_output(args.json, REPORT)  # before the runs, not after them
            for plan in args.plans.split(","):
                options = TrainOptions(data=args.data, plan=plan, steps=args.warmup + args.steps, comm=args.comm,
                                       backend=args.backend, model=args.model, dtype=args.dtype, dim=args.dim,
                                       num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                       shuffle=False)
                timed = run_training(options, device=launch.device, build_model=build_model)[args.warmup:]
                seconds = sum(s.seconds for s in timed)
                results.append({"plan": plan, "steps": len(timed), "tokens": sum(s.num_tokens for s in timed),
                                "seconds": seconds, "tokens_per_s": sum(s.num_tokens for s in timed) / seconds,
                                "kv_bytes_busiest": max(s.kv_bytes_busiest for s in timed),
                                "kv_bytes_total": sum(s.kv_bytes_total for s in timed) / len(timed),
                                "losses": [s.loss for s in timed]})
            if launch.rank == 0:
                report(results, args)
            status = 0
        except (FlashcpError, ValueError) as e:
            if launch.rank == 0:
                error(str(e))
            status = 1
    return status


REPORT = json_report("flashcp-train-throughput", "a scripts/train_throughput.py report")


def report(results: list[dict], args) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    base = results[0]
    print(f"{world} ranks, {args.model} model (dim {args.dim}, {args.layers} layers, "
          f"{args.heads}/{args.kv_heads} heads, {args.dtype}), comm {args.comm}, {base['steps']} timed steps "
          f"after {args.warmup} warm-up")
    print(f"{'plan':<26} {'tok/s':>9} {'vs first':>8} {'K/V MiB busiest rank/step':>26} "
          f"{'K/V MiB sent/step':>18} {'max |loss - first|':>19}")
    for r in results:
        loss_diff = max(abs(a - b) for a, b in zip(r["losses"], base["losses"]))
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        busiest, total = r["kv_bytes_busiest"] / 2**20, r["kv_bytes_total"] / 2**20
        print(f"{r['plan']:<26} {r['tokens_per_s']:>9,.0f} {ratio:>8.2f} {busiest:>26.2f} {total:>18.2f} "
              f"{loss_diff:>19.1e}")
    if args.json:
        write_json_output(args.json, REPORT, {"format": "flashcp-train-throughput", "plans": results})


if __name__ == "__main__":
    sys.exit(main())
