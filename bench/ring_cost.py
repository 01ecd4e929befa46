"""What the ring baselines cost by the cost model, beside the collective baselines, at the paper's scale.

    python bench/ring_cost.py [--context-len 131072] [--cp 8] [--seqs 20]

For sequences packed from the shipped WLB-LLM lengths and a log-normal Pile stand-in (each length rounded up
to a multiple of 2N so that the stand-in per-doc layout is exact), prints per layout + comm mode, averaged
over sequences (per-rank numbers: the largest over ranks): imbalance, kernel calls and varlen sequences
(query shards, summed over calls), the query rows merged by log-sum-exp and the keys the kernels read
(relative to the rank's tokens T; gathered copies unless they form one run of rows, as in the ring layout),
and K/V tokens received per forward pass relative to C (backward moves the same again for the collectives,
twice that for the ring). All from
``flashcp.planner.cost`` (``ring_step_work``, ``ring_comm_tokens``); layouts from the strategies registry when
present, else the test stand-ins.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ring_cpu import SYSTEMS, draw_sequence, planners  # noqa: E402
from flashcp.planner.cost import rank_tokens, rank_workloads, ring_comm_tokens, ring_step_work  # noqa: E402
from flashcp.runtime.meta import build_rank_metas  # noqa: E402


def collective_row(plan, doc_lens, cp: int) -> dict:
    """A collective mode (``full``): a local and a remote kernel call at most, shards over key prefixes."""
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    shards = np.bincount(plan.shard_rank, minlength=cp)
    prefix_keys = np.bincount(plan.shard_rank, weights=plan.shard_start + plan.shard_len, minlength=cp)
    metas = build_rank_metas(plan, doc_lens)
    calls = max((m.local.num_tokens > 0) + (m.remote.num_tokens > 0) for m in metas)
    return {"calls": float(calls), "sequences": float(shards.max()), "merged": 0.0,
            "gathered": float((prefix_keys / tokens).max()), "recv": float((cp - 1) * tokens.max())}


def ring_row(plan, cp: int) -> dict:
    """The ring: one call per step with work; partial outputs merged at every step after the first."""
    work = ring_step_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    return {"calls": float(work.kernel_calls.max()), "sequences": float(work.sequences.sum(axis=1).max()),
            "merged": float((work.query_tokens[:, 1:].sum(axis=1) / tokens).max()),
            "gathered": float((work.key_tokens.sum(axis=1) / tokens).max()),
            "recv": float(ring_comm_tokens(plan.shard_len, plan.shard_rank, cp)[1].max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cp, layouts = args.cp, planners()
    configs = [("llama3", "full"), ("perdoc", "full"), ("ring", "ring"), ("perdoc", "ring")]
    configs += [("flashcp", "auto")] if "flashcp" in layouts else []
    print(f"cost model, C={args.context_len} cp={cp}, {args.seqs} sequences per dataset; layouts from "
          f"{layouts['source']}; largest over ranks, mean over sequences")
    print(f"  {'data':<5} {'system':<19} {'layout+comm':<12} {'imbal':>6} {'calls':>6} {'seqs':>7} "
          f"{'merged/T':>9} {'keys/T':>7} {'K/V in/C':>9}")
    for dist_name in ("wlb", "pile"):
        rng = np.random.default_rng(args.seed)
        sequences = [draw_sequence(rng, dist_name, args.context_len, cp) for _ in range(args.seqs)]
        for layout, comm in configs:
            rows = []
            for doc_lens in sequences:
                plan = layouts[layout](doc_lens, cp)
                work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, cp)
                row = ring_row(plan, cp) if comm == "ring" else collective_row(plan, doc_lens, cp)
                rows.append({"imbalance": work.max() / work.mean(), **row})
            mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
            print(f"  {dist_name:<5} {SYSTEMS[(layout, comm)]:<19} {layout + '+' + comm:<12} "
                  f"{mean['imbalance']:>6.3f} {mean['calls']:>6.1f} {mean['sequences']:>7.1f} "
                  f"{mean['merged']:>9.2f} {mean['gathered']:>7.2f} {mean['recv'] / args.context_len:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
