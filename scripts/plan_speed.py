"""Planner speed against the plain-Python references: Numba kernels beside ``tests/naive.py``, and end to end.

``flashcp bench --scenario speed`` times the kernels (``flashcp/bench/speed.py`` describes what is timed). This
script runs that scenario with the plain-Python reference planners of ``tests/naive.py`` beside the kernels
(their sequences per second, the speedups, and whether their plans equal the kernels'), so it needs a source
checkout. The sequences are the ones ``flashcp bench --scenario speed --dist DIST --seed SEED`` times.

    python scripts/plan_speed.py --num-seqs 20000 --reference-seqs 100 --e2e-seqs 100000
    flashcp bench --scenario speed --dist pile --cp 8 --speed-seqs 20000 \
        --strategies llama3,perdoc,flashcp,flashcp+ --e2e-seqs 100000   # the same, without the references
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tests.naive  # noqa: E402
from flashcp import __version__  # noqa: E402
from flashcp.bench.report import print_speed  # noqa: E402
from flashcp.bench.sequences import open_source  # noqa: E402
from flashcp.bench.speed import end_to_end, planner_speed  # noqa: E402
from flashcp.bench.systems import PlanBook  # noqa: E402
from flashcp.cli.console import console, error, info  # noqa: E402
from flashcp.errors import FlashcpError  # noqa: E402
from flashcp.outputs import check_output, json_report, write_json_output  # noqa: E402

REPORT = json_report("flashcp-plan-speed", "a scripts/plan_speed.py report")
PYTHON_BUDGET_S = 10.0
"""Seconds a reference may plan per strategy when --reference-seqs is 0."""


def naive_planner(strategy: str):
    """``tests.naive.naive_<strategy>`` (``+`` spelt ``_plus``), or None when the strategy has none."""
    return getattr(tests.naive, "naive_" + strategy.replace("+", "_plus"), None)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dist", default="pile")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--num-seqs", type=int, default=20000, help="sequences for the kernel timing")
    parser.add_argument("--reference-seqs", type=int, default=200,
                        help=f"sequences for the Python reference (0: as many as fit in {PYTHON_BUDGET_S:.0f} s)")
    parser.add_argument("--strategies", default="llama3,perdoc,flashcp,flashcp+")
    parser.add_argument("--e2e-seqs", type=int, default=100000, help="0 skips the end-to-end run")
    parser.add_argument("--e2e-strategies", default="flashcp,flashcp+")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts, end-to-end run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """The speed rows with the references, and the end-to-end run when ``--e2e-seqs`` is above 0."""
    results: dict = {"format": "flashcp-plan-speed", "flashcp_version": __version__, "torch": torch.__version__,
                     "machine": platform.machine(), "config": vars(args), "seconds": {}}
    started = time.perf_counter()
    source = open_source(args.dist)
    info("plan_speed: kernels and references...")
    results["speed"] = planner_speed(PlanBook(args.seed), source, args.strategies.split(","),
                                     args.cp, args.context_len, args.num_seqs, PYTHON_BUDGET_S,
                                     args.reference_seqs or None, references=naive_planner)
    results["seconds"]["speed"] = time.perf_counter() - started
    if args.e2e_seqs:
        started = time.perf_counter()
        info("plan_speed: end to end...")
        results["end_to_end"] = end_to_end(source.spec, args.cp, args.context_len, args.e2e_seqs,
                                           args.e2e_strategies.split(","), [int(w) for w in args.workers.split(",")],
                                           args.seed)
        results["seconds"]["end_to_end"] = time.perf_counter() - started
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.json:
            check_output(args.json, REPORT)  # before the run, not after it
        results = run(args)
    except (FlashcpError, ValueError) as e:
        error(str(e))
        return 1
    print_speed(console, results["speed"], results.get("end_to_end"))
    if args.json:
        write_json_output(args.json, REPORT, results)
        info(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
