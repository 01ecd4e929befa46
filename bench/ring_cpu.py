"""CPU step time of cp_attention with ring vs collective comm on the same plans (gloo, reference kernels).

    torchrun --nproc-per-node 4 bench/ring_cpu.py [--context-len 4096] [--dist wlb|pile] [--seqs 2]

Every rank draws the same sequences (document lengths from the shipped WLB-LLM list, or a log-normal
stand-in for Pile, each rounded up to a multiple of 2N so that the stand-in per-doc layout is exact), plans
them with three layouts (``llama3``, ``perdoc`` from ``flashcp.planner.strategies`` when present, else the
test stand-ins; ``ring`` from ``flashcp.planner.ring``; plus ``flashcp`` with comm ``auto`` when the
strategies provide it) and times one attention layer's forward + backward (``cp_attention``, float32) with
comm ``full`` and ``ring`` on each. A step's time is the slowest rank's (median of ``--reps`` after a warm-up,
a barrier before each). The paper's five systems are the rows Llama3 CP (llama3+full), Per-Doc CP
(perdoc+full), Ring-Attn (ring+ring), Ring-Attn zigzag (perdoc+ring) and FlashCP (flashcp+auto).

CPU numbers only show the runtime's overheads (per-step kernel calls, gathers, merges, the second K/V round
of the ring's backward); the reference ``full`` path calls ``scaled_dot_product_attention`` while the ring's
reference kernel writes softmax and log-sum-exp out in PyTorch, so kernel speed differs too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp.planner.cost import rank_workloads, ring_step_work  # noqa: E402
from flashcp.planner.ring import ring_plan  # noqa: E402
from flashcp.runtime import CommStats, CPAttnMeta, cp_attention  # noqa: E402
from flashcp.runtime.meta import rank_token_positions  # noqa: E402

SYSTEMS = {("llama3", "full"): "Llama3 CP", ("perdoc", "full"): "Per-Doc CP", ("ring", "ring"): "Ring-Attn",
           ("perdoc", "ring"): "Ring-Attn (zigzag)", ("flashcp", "auto"): "FlashCP"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--dist", default="wlb", choices=("wlb", "pile"))
    parser.add_argument("--seqs", type=int, default=2, help="sequences to time")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per configuration (after a warm-up)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    return parser.parse_args(argv)


def draw_sequence(rng: np.random.Generator, dist_name: str, context_len: int, cp: int) -> np.ndarray:
    """Document lengths filling ``context_len``, each a multiple of ``2 * cp`` (the last one cut to fit)."""
    unit = 2 * cp
    if dist_name == "wlb":
        pool = np.array(json.loads((ROOT / "flashcp/data/dists/wlb.json").read_text()), dtype=np.int64)
        sample = rng.choice(pool, size=256)
    else:
        sample = np.maximum(1, rng.lognormal(math.log(1024), 1.4, size=256)).astype(np.int64)
    lens, total = [], 0
    for n in -(-sample // unit) * unit:
        n = int(min(n, context_len - total))
        lens.append(n)
        total += n
        if total == context_len:
            return np.array(lens, dtype=np.int64)
    raise RuntimeError("256 documents did not fill the context; raise the sample size")


def planners() -> dict:
    """layout name -> ``plan(doc_lens, cp)``; the strategies registry when present, else test stand-ins."""
    table = {"ring": ring_plan}
    try:
        from flashcp.planner.strategies import plan_sequence

        for name in ("llama3", "perdoc", "flashcp"):
            table[name] = lambda doc_lens, cp, name=name: plan_sequence(name, doc_lens, cp)
        table["source"] = "flashcp.planner.strategies"
    except ImportError:
        from tests.plans import llama3_like_plan, perdoc_like_plan

        table.update(llama3=llama3_like_plan, perdoc=perdoc_like_plan, source="tests/plans.py stand-ins")
    return table


def time_config(meta, q, k, v, grad, comm, group, reps) -> tuple[float, int]:
    """Median ms of forward + backward on this rank, and the K/V bytes it received in one step."""
    times, stats = [], CommStats()
    for i in range(reps + 1):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        stats.clear()
        dist.barrier(group)
        start = time.perf_counter()
        out = cp_attention(*leaves, meta, group=group, comm=comm, backend="reference", stats=stats)
        out.backward(grad)
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times)), stats.total("recv_bytes")


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.set_num_threads(1)
    if args.context_len % (2 * cp):
        raise SystemExit(f"--context-len must be a multiple of 2 * {cp}")
    rng = np.random.default_rng(args.seed)
    layouts = planners()
    configs = [(layout, comm) for layout in ("llama3", "perdoc", "ring") for comm in ("full", "ring")]
    configs += [("flashcp", "auto")] if "flashcp" in layouts else []
    rows = []
    for seq in range(args.seqs):
        doc_lens = draw_sequence(rng, args.dist, args.context_len, cp)
        gen = torch.Generator().manual_seed(seq)
        q_all, k_all, v_all = (torch.randn(args.context_len, h, args.head_dim, generator=gen)
                               for h in (args.heads, args.kv_heads, args.kv_heads))
        for layout, comm in configs:
            plan = layouts[layout](doc_lens, cp)
            meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
            pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
            grad = torch.randn(meta.num_tokens, args.heads, args.head_dim, generator=gen)
            local = (q_all[pos], k_all[pos], v_all[pos])
            ms, recv_bytes = time_config(meta, *local, grad, comm, group, args.reps)
            gathered = [None] * cp
            dist.all_gather_object(gathered, (ms, recv_bytes), group=group)
            work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, cp)
            ring_calls = ring_step_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank,
                                        cp).kernel_calls
            rank_ms = [g[0] for g in gathered]
            rows.append({"seq": seq, "docs": int(doc_lens.size), "layout": layout, "comm": comm,
                         "system": SYSTEMS.get((layout, comm), ""), "shards": plan.num_shards,
                         "imbalance": float(work.max() / work.mean()), "step_ms": max(rank_ms),
                         "mean_rank_ms": float(np.mean(rank_ms)),
                         "max_recv_mb": max(g[1] for g in gathered) / 2**20,
                         "ring_kernel_calls": int(ring_calls.max()) if comm == "ring" else None})
    if rank == 0:
        report(rows, args, cp, layouts["source"])
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()
    return 0


def report(rows, args, cp, source):
    print(f"cp_attention fwd+bwd, one layer, CPU gloo x{cp}, reference kernels, float32: "
          f"C={args.context_len} H={args.heads} H_kv={args.kv_heads} D={args.head_dim}, {args.dist} lengths, "
          f"{args.seqs} sequences, median of {args.reps}; layouts from {source}")
    print(f"  {'seq':>3} {'docs':>4} {'layout':<8} {'comm':<5} {'system':<19} {'shards':>6} {'imbal':>6} "
          f"{'step ms':>9} {'mean ms':>9} {'recv MB':>8} {'ring calls':>10}")
    for r in rows:
        calls = "" if r["ring_kernel_calls"] is None else r["ring_kernel_calls"]
        print(f"  {r['seq']:>3} {r['docs']:>4} {r['layout']:<8} {r['comm']:<5} {r['system']:<19} "
              f"{r['shards']:>6} {r['imbalance']:>6.3f} {r['step_ms']:>9.1f} {r['mean_rank_ms']:>9.1f} "
              f"{r['max_recv_mb']:>8.2f} {calls:>10}")
    mean = {}
    for r in rows:
        mean.setdefault((r["layout"], r["comm"]), []).append(r["step_ms"])
    mean = {key: float(np.mean(v)) for key, v in mean.items()}
    print("  mean step time, ring / full on the same layout: " + ", ".join(
        f"{layout} {mean[(layout, 'ring')] / mean[(layout, 'full')]:.2f}x"
        for layout in ("llama3", "perdoc", "ring")))
    for baseline in (("ring", "ring"), ("perdoc", "ring")):
        others = [key for key in SYSTEMS if key in mean and key != baseline]
        print(f"  {SYSTEMS[baseline]} step time over: " + ", ".join(
            f"{SYSTEMS[key]} {mean[baseline] / mean[key]:.2f}x" for key in others))


if __name__ == "__main__":
    sys.exit(main())
