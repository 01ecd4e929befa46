"""flashcp2 planned for a model against the peers' default plans, under the projection for that model.

For each built-in model with its layer kinds (full, window, chunk), each distribution at 128K tokens and each
of cp 8 (one node), cp 16 (one node) and cp 16 on 2 nodes x 8, plans ``--seqs`` packed sequences with
``flashcp2 --model`` and with flashcp+, magi, flashcp, llama3 and ptrr at their defaults, and prints the mean
and the largest of flashcp2's step time over each peer's (``project_step(..., "auto", overlap=True)``, the
model's mean layer; below 1: flashcp2 faster). PROJECTED numbers from the default hardware profile.

    python scripts/kind_peers.py --seqs 20
"""

from __future__ import annotations

import argparse

import numpy as np

from flashcp.costmodel.models import resolve_model
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.data.synth import load_distribution, pack_lengths
from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies.flashcp2 import PEERS

MODELS = ("llama-3-8b", "gemma-3-12b", "gpt-oss-20b", "llama-4-scout")
LAYOUTS = ((8, 0), (16, 0), (16, 8))
"""(cp, gpus per node): one node, or nodes of that many ranks."""


def sequences(dist: str, num_seqs: int, context_len: int, seed: int) -> list[np.ndarray]:
    """Packed sequences' document lengths from a built-in distribution (as ``flashcp synth`` packs them)."""
    offsets, lens, *_ = pack_lengths(load_distribution(dist), np.random.default_rng(seed), num_seqs, context_len)
    return [lens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(num_seqs)]


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=20)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--dists", default="wlb,prolong")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = load_profile()
    print(f"flashcp2 step time / peer's, mean (max) over {args.seqs} sequences of {args.context_len} tokens; "
          "PROJECTED, auto comm, overlap")
    print(f"| model | dist | cp | nodes | {' | '.join(PEERS)} |")
    print("|---" * (4 + len(PEERS)) + "|")
    for name in MODELS:
        model = resolve_model(name)
        shape = model.attention_shape()
        for dist in args.dists.split(","):
            seqs = sequences(dist, args.seqs, args.context_len, args.seed)
            for cp, per_node in LAYOUTS:
                topology = {"topology": f"{cp // per_node}x{per_node}"} if per_node else {}
                ratios: dict[str, list[float]] = {peer: [] for peer in PEERS}
                for lens in seqs:
                    def seconds(plan):
                        return project_step(plan, shape, profile, "auto", True, gpus_per_node=per_node).total

                    ours = seconds(plan_sequence("flashcp2", lens, cp, model=model, **topology))
                    for peer in PEERS:
                        ratios[peer].append(ours / seconds(plan_sequence(peer, lens, cp)))
                cells = " | ".join(f"{np.mean(r):.3f} ({max(r):.3f})" for r in ratios.values())
                nodes = f"{cp // per_node}x{per_node}" if per_node else "1"
                print(f"| {name} | {dist} | {cp} | {nodes} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
