"""Write a synthetic planned dataset for the training benchmark, with plans from the test plan builders.

    python bench/standin_data.py DATA --cp 2 --context-len 8192 --num-seqs 10

Document lengths are drawn from a named distribution (flashcp/data/dists/<name>.json), rounded up to a
multiple of ``2 * cp`` so that the Per-Doc pattern (every document in ``2 * cp`` equal chunks) meets the
equal-token quotas exactly; the last document of a sequence is cut to fit. Token ids are random. Plans:

- ``cp{N}-llama3``: the whole sequence in ``2N`` chunks, rank i gets chunks i and 2N-1-i (DESIGN.md's llama3);
- ``cp{N}-perdoc``: every document in ``2N`` chunks, same assignment (DESIGN.md's perdoc on these lengths);
- ``cp{N}-whole-doc-greedy``: a stand-in with FlashCP's pattern (longest documents first, kept whole on
  the least-loaded rank with room, heads split off only when nothing fits);
- every strategy of ``flashcp.planner.strategies`` when it exists, as ``cp{N}-<name>`` (the real ``llama3``
  and ``perdoc`` then replace the stand-ins).

Once ``flashcp synth`` and ``flashcp plan`` exist, they make the same kind of dataset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.plans import (  # noqa: E402
    llama3_like_plan,
    perdoc_like_plan,
    plan_builders,
    whole_doc_greedy_plan,
    write_dataset,
    write_plan,
)


def sequence_lengths(rng, lengths, context_len: int, multiple: int) -> np.ndarray:
    """Document lengths (multiples of ``multiple``) that fill ``context_len`` exactly."""
    lens, total = [], 0
    while total < context_len:
        n = int(-(-int(rng.choice(lengths)) // multiple) * multiple)
        n = min(n, context_len - total)
        lens.append(n)
        total += n
    return np.array(lens, dtype=np.int64)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", type=Path)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--context-len", type=int, default=8192)
    parser.add_argument("--num-seqs", type=int, default=10)
    parser.add_argument("--dist", default="prolong", choices=("wlb", "prolong"),
                        help="document length distribution (flashcp/data/dists)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.context_len % (2 * args.cp):
        parser.error(f"--context-len must be a multiple of 2 * cp = {2 * args.cp}")
    rng = np.random.default_rng(args.seed)
    dist_file = ROOT / "flashcp" / "data" / "dists" / f"{args.dist}.json"
    lengths = np.array(json.loads(dist_file.read_text()), dtype=np.int64)
    rows = [sequence_lengths(rng, lengths, args.context_len, 2 * args.cp) for _ in range(args.num_seqs)]
    dataset, _ = write_dataset(args.data, [rows], args.context_len, rng, row_group_rows=4)
    builders = {"llama3": llama3_like_plan, "perdoc": perdoc_like_plan,
                "whole-doc-greedy": whole_doc_greedy_plan}
    # the real strategies, when the planner has them, replace the stand-ins of the same name
    builders.update({k: v for k, v in plan_builders().items() if k not in ("llama3-like", "random")})
    for name, build in builders.items():
        plans = [build(lens, args.cp) for lens in rows]
        for plan, lens in zip(plans, rows):
            plan.validate(lens)
        write_plan(dataset, f"cp{args.cp}-{name}", [plans], args.cp)
        imbalance = np.mean([p.metrics().imbalance for p in plans])
        print(f"cp{args.cp}-{name}: mean imbalance {imbalance:.3f}, "
              f"{np.mean([p.num_shards for p in plans]):.1f} shards per sequence")
    print(f"wrote {args.num_seqs} sequences of {args.context_len} tokens "
          f"({np.mean([len(r) for r in rows]):.1f} documents each) to {args.data}")


if __name__ == "__main__":
    main()
