"""Planner speed: Numba kernels against the plain-Python references, and end to end: ``flashcp bench --scenario
speed``.

Kept for its command line; the scenario lives in ``flashcp/bench/speed.py`` (what is timed is described there).
These two commands run the same thing:

    python bench/plan_speed.py --num-seqs 20000 --reference-seqs 100 --e2e-seqs 100000
    flashcp bench --scenario speed --dist pile --cp 8 --speed-seqs 20000 --reference-seqs 100 \
        --strategies llama3,perdoc,flashcp,flashcp+ --e2e-seqs 100000
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
    parser.add_argument("--dist", default="pile")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--num-seqs", type=int, default=20000, help="sequences for the kernel timing")
    parser.add_argument("--reference-seqs", type=int, default=200, help="sequences for the Python reference")
    parser.add_argument("--strategies", default="llama3,perdoc,flashcp,flashcp+")
    parser.add_argument("--e2e-seqs", type=int, default=100000, help="0 skips the end-to-end run")
    parser.add_argument("--e2e-strategies", default="flashcp,flashcp+")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts, end-to-end run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    out = ["bench", "--scenario", "speed", "--dist", args.dist, "--cp", str(args.cp), "--context-len",
           str(args.context_len), "--speed-seqs", str(args.num_seqs), "--reference-seqs", str(args.reference_seqs),
           "--strategies", args.strategies, "--e2e-seqs", str(args.e2e_seqs), "--e2e-strategies",
           args.e2e_strategies, "--workers", args.workers, "--seed", str(args.seed)]
    return out + (["--json", args.json] if args.json else [])


if __name__ == "__main__":
    cli.main(args=bench_args(), prog_name="flashcp")
