"""Plan quality of every strategy on synthetic packed sequences: ``flashcp bench --scenario quality``.

Kept for its command line; the scenario lives in ``flashcp/bench/quality.py`` (columns and targets are
described there). These two commands run the same thing:

    python bench/plan_quality.py --num-seqs 2000 --cp 4,8,16 --dists wlb,prolong,pile \
        --strategies llama3,perdoc,flashcp,flashcp+,magi,ptrr,flashcp2 --json quality.json
    flashcp bench --scenario quality --seqs 2000 --cp 4,8,16 --dist wlb,prolong,pile \
        --strategies llama3,perdoc,flashcp,flashcp+,magi,ptrr,flashcp2 --json quality.json

``--json`` writes the bench's JSON (the rows are under ``quality.rows``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp.cli import cli  # noqa: E402


def bench_args(argv=None) -> list[str]:
    """The ``flashcp bench`` arguments of this script's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dists", default="wlb,prolong,pile", help="comma-separated distributions")
    parser.add_argument("--cp", default="4,8", help="comma-separated CP sizes")
    parser.add_argument("--strategies", default="llama3,perdoc,flashcp,flashcp+,flashcp+@1.05",
                        help="comma-separated strategies, each NAME[@TARGET][:KEY=VALUE;...]")
    parser.add_argument("--num-seqs", type=int, default=2000)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument("--price-tokens", action="store_true",
                        help="step ms also prices the per-token layers (to compare plans made with token slack)")
    args = parser.parse_args(argv)
    out = ["bench", "--scenario", "quality", "--dist", args.dists, "--cp", args.cp, "--strategies",
           args.strategies, "--seqs", str(args.num_seqs), "--context-len", str(args.context_len), "--seed",
           str(args.seed)]
    return out + (["--json", args.json] if args.json else []) + (["--price-tokens"] if args.price_tokens else [])


if __name__ == "__main__":
    cli.main(args=bench_args(), prog_name="flashcp")
