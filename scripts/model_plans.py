"""Plans made for the model being trained, and the exact-need bytes of windowed and chunked layers.

Two tables, both PROJECTED from the default hardware profile (``project_step(..., "auto", overlap=True)``),
over ``--seqs`` packed sequences of each distribution at 128K tokens, cp 8 and 16 on one node and cp 16 on
2 nodes x 8:

1. For each built-in model: ``flashcp2`` planned for it (``--model``) against ``flashcp2`` planned for the old
   default (32 heads, 32 K/V heads, head dim 128, every layer full attention), both priced for the model:
   step time (every layer, forward + backward) and the exact-need K/V bytes the busiest rank receives per
   step (each layer kind's own need, forward K/V plus backward dK/dV).
2. For each model with window or chunk layers: the exact-need bytes per step, all ranks together and the
   busiest rank, of its ``flashcp2`` plans against the same model with every layer full attention (planned
   for that model).

    python scripts/model_plans.py --seqs 20
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from flashcp.costmodel.comm import exchange_volumes, kv_bytes_per_token
from flashcp.costmodel.models import BUILTIN_MODELS, LayerKind, ModelSpec
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.workload import KIND_CODES
from flashcp.data.synth import load_distribution, pack_lengths
from flashcp.planner.planning import plan_sequence

LAYOUTS = ((8, 0), (16, 0), (16, 8))
"""(cp, gpus per node): one node, or nodes of that many ranks."""


def sequences(dist: str, num_seqs: int, context_len: int, seed: int) -> list[np.ndarray]:
    """Packed sequences' document lengths from a built-in distribution (as ``flashcp synth`` packs them)."""
    offsets, lens, *_ = pack_lengths(load_distribution(dist), np.random.default_rng(seed), num_seqs, context_len)
    return [lens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(num_seqs)]


def all_full(model: ModelSpec) -> ModelSpec:
    """The same model with every layer full causal attention."""
    return dataclasses.replace(model, name=f"{model.name} all-full", layers=(LayerKind(),) * model.num_layers)


def step_bytes(plan, model: ModelSpec) -> tuple[float, float]:
    """(all ranks, busiest rank) exact-need bytes received per step: every layer with its kind's need,
    forward K/V and backward dK/dV (the all-to-all moves the same rows back)."""
    row = kv_bytes_per_token(model.num_kv_heads, model.head_dim, 2)
    per_rank = np.zeros(plan.cp)
    for layer, count in model.kind_counts().items():
        volumes = exchange_volumes(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp,
                                   kind=KIND_CODES[layer.kind], size=layer.size or 0)
        per_rank += 2.0 * count * row * volumes.received
    return float(per_rank.sum()), float(per_rank.max())


def step_seconds(plan, model: ModelSpec, profile, per_node: int) -> float:
    """Projected step time of every layer, forward + backward (the projection prices the mean layer)."""
    shape = model.attention_shape()
    return project_step(plan, shape, profile, "auto", True, gpus_per_node=per_node).total * model.num_layers


def topology(cp: int, per_node: int) -> dict:
    return {"topology": f"{cp // per_node}x{per_node}"} if per_node else {}


def main() -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=20)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--dists", default="wlb,prolong")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.seqs < 1 or args.context_len < 16:
        sys.exit("--seqs must be at least 1 and --context-len at least 16")
    profile = load_profile()
    data = {dist: sequences(dist, args.seqs, args.context_len, args.seed) for dist in args.dists.split(",")}
    print(f"Table 1: flashcp2 planned for the model vs for the old MHA default, priced for the model; mean over "
          f"{args.seqs} sequences of {args.context_len} tokens (PROJECTED)")
    print("| model | dist | cp | nodes | step ms, for MHA | step ms, for model | ratio (max) "
          "| busiest rank GB recv, for MHA | for model |")
    print("|---" * 9 + "|")
    for model in BUILTIN_MODELS.values():
        for dist, seqs in data.items():
            for cp, per_node in LAYOUTS:
                old_t, new_t, ratio, old_b, new_b = [], [], [], [], []
                for lens in seqs:
                    old = plan_sequence("flashcp2", lens, cp, **topology(cp, per_node))
                    new = plan_sequence("flashcp2", lens, cp, model=model, **topology(cp, per_node))
                    old_t.append(step_seconds(old, model, profile, per_node))
                    new_t.append(step_seconds(new, model, profile, per_node))
                    ratio.append(new_t[-1] / old_t[-1])
                    old_b.append(step_bytes(old, model)[1])
                    new_b.append(step_bytes(new, model)[1])
                nodes = f"2x{per_node}" if per_node else "1"
                print(f"| {model.name} | {dist} | {cp} | {nodes} | {1e3 * np.mean(old_t):.1f} | "
                      f"{1e3 * np.mean(new_t):.1f} | {np.mean(ratio):.3f} ({max(ratio):.3f}) | "
                      f"{np.mean(old_b) / 1e9:.2f} | {np.mean(new_b) / 1e9:.2f} |", flush=True)
    print()
    print("Table 2: exact-need bytes per step (GB, received, forward + backward, every layer), the model's "
          "layer kinds vs the same model all full attention, each planned with flashcp2 for itself")
    print("| model | dist | cp | all ranks, kinds | all ranks, all-full | ratio | busiest, kinds | busiest, all-full "
          "| ratio |")
    print("|---" * 9 + "|")
    for model in BUILTIN_MODELS.values():
        if all(layer.kind == "full" for layer in model.layers):
            continue
        full = all_full(model)
        for dist, seqs in data.items():
            for cp in (8, 16):
                kinds = np.array([step_bytes(plan_sequence("flashcp2", lens, cp, model=model), model)
                                  for lens in seqs])
                fulls = np.array([step_bytes(plan_sequence("flashcp2", lens, cp, model=full), full)
                                  for lens in seqs])
                k_all, k_max = kinds.mean(0) / 1e9
                f_all, f_max = fulls.mean(0) / 1e9
                print(f"| {model.name} | {dist} | {cp} | {k_all:.2f} | {f_all:.2f} | {k_all / f_all:.3f} | "
                      f"{k_max:.2f} | {f_max:.2f} | {k_max / f_max:.3f} |", flush=True)


if __name__ == "__main__":
    main()
