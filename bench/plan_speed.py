"""Planner speed: Numba kernels against the plain-Python references, and the end-to-end ``plan`` pipeline.

1. Kernels: sequences/s of ``plan_batch`` (one core) per strategy, alone and with the batch validator that
   recomputes every plan's metrics; and of the plain-Python reference (tests/naive.py) on a subset of the
   same sequences, in the same run. The plans are compared for equality on that subset.
2. End to end: a lengths-only dataset of ``--e2e-seqs`` sequences is synthesised in a temporary folder and
   planned with ``plan_dataset`` (read, plan, validate, baselines, write) for each ``--workers`` value.

Run from the repository root:

    python bench/plan_speed.py --num-seqs 20000 --e2e-seqs 100000
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashcp.data.synth import load_distribution, pack_lengths, synth_dataset  # noqa: E402
from flashcp.planner import _batch  # noqa: E402
from flashcp.planner.pipeline import plan_dataset  # noqa: E402
from flashcp.planner.strategies import get_strategy, resolve_params  # noqa: E402
from flashcp.planner.verify import verify_dataset  # noqa: E402
from tests.naive import naive_flashcp, naive_flashcp_plus, naive_llama3, naive_perdoc  # noqa: E402

REFERENCES = {"llama3": naive_llama3, "perdoc": naive_perdoc, "flashcp": naive_flashcp,
              "flashcp+": naive_flashcp_plus}


def _cpu_seconds() -> float:
    """CPU time of this process (user + system): what one core spent, whatever else the machine runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Timer:
    """Wall and CPU seconds of a block."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), _cpu_seconds()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, _cpu_seconds() - self.cpu


def kernel_speed(strategies, dist, cp, context_len, num_seqs, reference_seqs, seed):
    offsets, lens, _, _, _ = pack_lengths(load_distribution(dist), np.random.default_rng(seed), num_seqs,
                                          context_len)
    print(f"kernels: {num_seqs:,} {dist} sequences of {context_len:,} tokens, cp {cp}, one core; Python "
          f"reference on the first {reference_seqs:,} (rates per CPU-second; wall-clock rate in brackets)")
    head = (f"{'strategy':10s} {'plan seq/s':>20s} {'plan+check seq/s':>20s} {'python seq/s':>13s} "
            f"{'speedup':>9s}")
    print(head)
    print("-" * len(head))
    for name in strategies:
        strategy = get_strategy(name)
        target = float(resolve_params(strategy).get("target_imbalance", 1.0))
        _batch.plan_batch(offsets[:2], lens, cp, strategy.code, target)  # load the compiled kernels
        with Timer() as plan_t:
            out = _batch.plan_batch(offsets, lens, cp, strategy.code, target)
        _batch.check_batch(offsets[:2], lens, out[0][:2], *out[1:], cp)
        with Timer() as check_t:
            errors, *_ = _batch.check_batch(offsets, lens, *out, cp)
        assert not errors.any()
        with Timer() as python_t:
            for i in range(reference_seqs):
                expected = REFERENCES[name](lens[offsets[i]:offsets[i + 1]].tolist(), cp)
                lo, hi = out[0][i], out[0][i + 1]
                got = list(zip(*(a[lo:hi].tolist() for a in out[1:])))
                assert got == expected, f"{name}: kernel and reference differ on sequence {i}"
        plan_rate, python_rate = num_seqs / plan_t.cpu, reference_seqs / python_t.cpu
        wall_both = num_seqs / (plan_t.wall + check_t.wall)
        both = f"{num_seqs / (plan_t.cpu + check_t.cpu):,.0f} ({wall_both:,.0f})"
        print(f"{name:10s} {f'{plan_rate:,.0f} ({num_seqs / plan_t.wall:,.0f})':>20s} {both:>20s} "
              f"{python_rate:13,.1f} {plan_rate / python_rate:8,.0f}x")


def end_to_end(dist, cp, context_len, num_seqs, strategies, workers_list, seed):
    with tempfile.TemporaryDirectory(prefix="flashcp-speed-") as tmp:
        root = Path(tmp) / "data"
        started = time.perf_counter()
        synth_dataset(root, dist=dist, num_seqs=num_seqs, context_len=context_len, seed=seed,
                      with_tokens=False)
        synth_s = time.perf_counter() - started
        size = sum(f.stat().st_size for f in (root / "data").iterdir())
        print(f"end to end: synth --no-tokens {num_seqs:,} x {context_len:,} {dist}: {synth_s:.1f}s, "
              f"{size / 2 ** 20:.1f} MiB")
        for name in strategies:
            for workers in workers_list:
                started = time.perf_counter()
                meta = plan_dataset(root, cp, name, workers=workers, force=True, name=f"w{workers}-{name}")
                elapsed = time.perf_counter() - started
                print(f"  plan --cp {cp} --strategy {name} --workers {workers}: {elapsed:.1f}s "
                      f"({num_seqs / elapsed:,.0f} seq/s end to end; read, plan, validate, baselines on "
                      f"every {meta['summary']['baselines_every_nth_sequence']}th, write)")
        started = time.perf_counter()
        report = verify_dataset(root)
        print(f"  verify ({len(report.plans)} plans): {time.perf_counter() - started:.1f}s")


def main():
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
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs visible; numba kernels are single-threaded")
    kernel_speed(args.strategies.split(","), args.dist, args.cp, args.context_len, args.num_seqs,
                 args.reference_seqs, args.seed)
    if args.e2e_seqs:
        print()
        end_to_end(args.dist, args.cp, args.context_len, args.e2e_seqs, args.e2e_strategies.split(","),
                   [int(w) for w in args.workers.split(",")], args.seed)


if __name__ == "__main__":
    main()
