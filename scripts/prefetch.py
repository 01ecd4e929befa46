"""Host time to build a batch, and the wait the training loop sees, with and without the prefetch thread.

    python scripts/prefetch.py [--context-len 131072] [--cp 8] [--seqs 16] [--step-ms 100] [--data DIR]

Writes a synthetic dataset (``flashcp synth --dist wlb``) and plans it with ``flashcp+`` and ``perdoc``
(unless ``--data`` names one already planned so), then walks the sequences as rank 0 of the CP group twice:

- inline: ``next(loader)`` on the training thread, then the step; the wait is the whole build;
- prefetch: ``flashcp.runtime.prefetch.Prefetcher`` (depth 2) builds on a thread; the wait is the time
  ``next()`` blocks.

The step is a ``time.sleep(--step-ms)``: a stand-in for a GPU step, whose host thread mostly waits on CUDA
and NCCL with the GIL released. Reported: mean host time per batch (the build, measured where it runs) and
mean loop wait per step, the first step excluded (nothing can be built before the loop starts).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashcp.runtime import CPLoader
from flashcp.runtime.prefetch import Prefetcher

STRATEGIES = ("flashcp+", "perdoc")


def make_data(root: Path, context_len: int, cp: int, seqs: int) -> None:
    flashcp = [sys.executable, "-m", "flashcp"]
    subprocess.run([*flashcp, "synth", str(root), "--dist", "wlb", "--num-seqs", str(seqs), "--context-len",
                    str(context_len)], check=True, capture_output=True)
    for strategy in STRATEGIES:
        subprocess.run([*flashcp, "plan", str(root), "--cp", str(cp), "--strategy", strategy], check=True,
                       capture_output=True)


def inline(loader: CPLoader, steps: int, step_s: float) -> tuple[list[float], list[float]]:
    batches = iter(loader)
    waits = []
    for _ in range(steps):
        began = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - began)
        time.sleep(step_s)
    return waits, waits


def prefetched(loader: CPLoader, steps: int, step_s: float) -> tuple[list[float], list[float]]:
    waits = []
    with Prefetcher(loader, depth=2) as prefetcher:
        for _ in range(steps):
            began = time.perf_counter()
            next(prefetcher)
            waits.append(time.perf_counter() - began)
            time.sleep(step_s)
        return list(prefetcher.host_seconds[:steps]), waits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context-len", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--data", help="a dataset already planned as cp{N}-flashcp+ and cp{N}-perdoc")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data) if args.data else Path(tmp) / "data"
        if not args.data:
            make_data(root, args.context_len, args.cp, args.seqs)
        print(f"C={args.context_len} cp {args.cp}, rank 0, {args.seqs} sequences, step {args.step_ms:.0f} ms "
              "(sleep); mean over steps 2..n")
        print(f"{'plan':<9} {'mode':<9} {'host ms/batch':>14} {'loop wait ms/step':>18}")
        for strategy in STRATEGIES:
            for mode, run in (("inline", inline), ("prefetch", prefetched)):
                loader = CPLoader(root, f"cp{args.cp}-{strategy}", 0, args.cp, shuffle=False)
                host, waits = run(loader, args.seqs, args.step_ms / 1000)
                print(f"{strategy:<9} {mode:<9} {1000 * statistics.mean(host[1:]):>14.1f} "
                      f"{1000 * statistics.mean(waits[1:]):>18.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
