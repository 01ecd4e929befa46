"""CPU seconds per batch that ``CPLoader`` spends on one rank, across CP sizes, at C = 1,048,576.

    python scripts/loader_host_cost.py [--data DIR] [--cp 8,16,32,64] [--strategy flashcp2] [--seqs 8] [--online]

Without ``--data`` it writes a synthetic dataset with token ids (``flashcp synth --dist wlb --context-len
1048576``) into a temporary folder and plans it at every ``--cp`` (``flashcp plan --cp N --strategy S``); with
``--data`` it uses the plans ``cp{N}-{S}`` found there (planning the missing ones would write into the dataset,
so it refuses instead).

For each CP size it walks every sequence as rank 0 and as the middle rank ``cp // 2`` (no shuffle), once to
warm up (Numba's compiled kernels load, the Parquet file opens), then ``--passes`` times measured: the
process's CPU time (``time.process_time``) around each ``next()``: reading the row group, slicing this rank's
tokens and labels, and building its ``CPAttnMeta``. Reported: mean and largest CPU milliseconds per batch.

``--online`` loads with ``plan=None`` instead (each sequence planned as it is read, the default strategy; no
plan needed in ``--data``, whose context length is then any): the difference to the stored plan's row is the
planning cost per sequence. The warm-up pass also loads the planner's compiled kernels.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashcp.runtime import CPLoader

CONTEXT_LEN = 1_048_576


def make_data(root: Path, cps: list[int], strategy: str, seqs: int) -> None:
    flashcp = [sys.executable, "-m", "flashcp"]
    subprocess.run([*flashcp, "synth", str(root), "--dist", "wlb", "--num-seqs", str(seqs), "--context-len",
                    str(CONTEXT_LEN), "--seed", "0"], check=True, capture_output=True)
    for cp in cps:
        subprocess.run([*flashcp, "plan", str(root), "--cp", str(cp), "--strategy", strategy], check=True,
                       capture_output=True)


def cpu_ms_per_batch(data: Path, plan: str | None, cp: int, rank: int, passes: int) -> list[float]:
    loader = CPLoader(data, plan, rank, cp, shuffle=False)
    for _ in loader:  # warm-up pass
        pass
    times = []
    for _ in range(passes):
        batches = iter(loader)
        while True:
            began = time.process_time()
            try:
                next(batches)
            except StopIteration:
                break
            times.append(1e3 * (time.process_time() - began))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="a dataset with token ids at C = 1,048,576, planned at every --cp")
    parser.add_argument("--cp", default="8,16,32,64", help="CP sizes, comma-separated")
    parser.add_argument("--strategy", default="flashcp2")
    parser.add_argument("--seqs", type=int, default=8, help="sequences of the synthetic dataset")
    parser.add_argument("--passes", type=int, default=2, help="measured passes over the sequences")
    parser.add_argument("--online", action="store_true", help="plan=None: plan each sequence as it is read")
    args = parser.parse_args()
    cps = [int(c) for c in args.cp.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            data = Path(tmp) / "data"
            make_data(data, cps, args.strategy, args.seqs)
        missing = [cp for cp in cps if not args.online
                   and not (data / "plans" / f"cp{cp}-{args.strategy}" / "plan.json").is_file()]
        if missing:
            sys.exit(f"{data} has no plan cp{missing[0]}-{args.strategy}; run 'flashcp plan {data} --cp "
                     f"{missing[0]} --strategy {args.strategy}' first")
        print("| cp | rank | CPU ms per batch, mean | max |")
        print("| --- | --- | --- | --- |")
        for cp in cps:
            for rank in sorted({0, cp // 2}):
                plan = None if args.online else f"cp{cp}-{args.strategy}"
                times = cpu_ms_per_batch(data, plan, cp, rank, args.passes)
                print(f"| {cp} | {rank} | {sum(times) / len(times):.1f} | {max(times):.1f} |", flush=True)


if __name__ == "__main__":
    main()
