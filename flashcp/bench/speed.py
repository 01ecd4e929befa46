"""Scenario 2, planner speed: sequences per second of each strategy's Numba kernels.

All run in one process, one core, on the same sequences: ``plan_sequence`` one sequence at a time; and the
batch kernel over all sequences (the call ``planning.plan_rows`` makes), alone and with the batch validator
that recomputes every plan's metrics (together what ``flashcp plan`` runs per file). Batch rates are given per
CPU-second of this process (what one core spent, whatever else the machine runs) and per wall-clock second.
The Numba kernels are compiled (or loaded from the cache) on a first sequence that is not timed.

A caller may add plain-Python reference planners (``references``; ``scripts/plan_speed.py`` passes the ones in
``tests/naive.py``, which a source checkout has): each runs on the first ``reference_seqs`` sequences, or until
``python_budget_s`` is spent (at least one sequence), timed the same way, and its shards are checked equal to
the kernel's. ``flashcp bench`` runs without them.

Optionally, end to end: a lengths-only dataset of ``e2e_seqs`` sequences is synthesised in a temporary folder
and planned with ``plan_dataset`` (read, plan, validate, write, and the comparison with the baselines on
``--compare``'s default number of sequences) per strategy and worker count, then verified.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flashcp.bench.systems import PlanBook

__all__ = ["References", "end_to_end", "planner_speed"]

References = Callable[[str], Callable[[list[int], int], list] | None]
"""``references(strategy)``: a plain-Python planner of that strategy, ``reference(doc_lens, cp) -> shards`` as
``(doc, start, len, rank)`` tuples, or None."""


class _Timer:
    """Wall and CPU seconds of a block (CPU: this process, user + system)."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = max(time.perf_counter() - self.wall, 1e-9)
        self.cpu = max(time.process_time() - self.cpu, 1e-9)


def _kernel(strategy, params: dict, offsets, lens, cp: int):
    """The batch kernel ``planning.plan_rows`` runs for ``strategy``: flat ``(offsets, doc, start, len, rank)``."""
    from flashcp.planner import batch
    from flashcp.planner.params import kernel_args

    return batch.plan_batch(offsets, lens, cp, strategy, **kernel_args(strategy, params))


def _checker(params: dict):
    """The validator ``planning.plan_rows`` runs after the kernel: ``check(offsets, lens, *flat_plans, cp)``."""
    from flashcp.planner.check import check_batch

    slack = float(params.get("token_slack", 0.0))
    validate: Any = check_batch  # a Numba dispatcher
    return lambda *args: validate(*args, slack)


def _batch_timing(strategy, params: dict, offsets, lens, cp: int) -> tuple[_Timer, _Timer, tuple]:
    """Timers of the batch kernel and of the validator over all rows, and the kernel's flat plans."""
    check = _checker(params)
    first = _kernel(strategy, params, offsets[:2], lens, cp)  # compile or load outside the timing
    check(offsets[:2], lens, *first, cp)
    with _Timer() as kernel_t:
        out = _kernel(strategy, params, offsets, lens, cp)
    with _Timer() as check_t:
        errors, *_ = check(offsets, lens, *out, cp)
    if errors.any():
        raise AssertionError(f"{strategy.name}: the batch kernel made an invalid plan of row "
                             f"{int(np.flatnonzero(errors)[0])}")
    return kernel_t, check_t, out


def planner_speed(book: PlanBook, source, strategies: list[str], cp: int, context_len: int, num_seqs: int,
                  python_budget_s: float = 5.0, reference_seqs: int | None = None, *,
                  references: References | None = None) -> dict:
    """Rows per strategy spec: per-sequence and batch (kernel; kernel + check) rates; see the module.

    With ``references`` the rows also hold the Python reference's rates, the speedups and whether its plans
    are the kernel's (None where a spec has no reference: one with parameters of its own);
    ``reference_seqs`` runs it on exactly that many sequences instead of for ``python_budget_s`` seconds.
    """
    from flashcp.bench.quality import parse_strategy
    from flashcp.planner.params import resolve_params
    from flashcp.planner.planning import plan_sequence
    from flashcp.planner.registry import get_strategy

    c = source.dataset_context_len or context_len
    sequences = book.sequences(source, num_seqs, c)
    offsets = np.r_[0, np.cumsum([s.size for s in sequences])].astype(np.int64)
    lens = np.concatenate(sequences).astype(np.int64)
    rows = []
    for spec, name, params in (parse_strategy(s) for s in strategies):
        strategy = get_strategy(name)
        plan_sequence(strategy, sequences[0], cp, **params)  # compile or load the kernels outside the timing
        started = time.perf_counter()
        for doc_lens in sequences:
            plan_sequence(strategy, doc_lens, cp, **params)
        numba_rate = len(sequences) / max(time.perf_counter() - started, 1e-9)
        kernel_t, check_t, out = _batch_timing(strategy, params, offsets, lens, cp)
        n = len(sequences)
        row = {"source": source.label, "context_len": c, "cp": cp, "strategy": spec, "num_seqs": n,
               "numba_seqs_per_s": numba_rate,
               "kernel_seqs_per_cpu_s": n / kernel_t.cpu, "kernel_seqs_per_s": n / kernel_t.wall,
               "batch_seqs_per_cpu_s": n / (kernel_t.cpu + check_t.cpu),
               "batch_seqs_per_s": n / (kernel_t.wall + check_t.wall)}
        rows.append(row)
        if references is None:
            continue
        row.update(python_seqs_per_s=None, python_seqs_per_cpu_s=None, python_seqs=0, speedup=None,
                   kernel_speedup=None, python_matches=None)
        reference = references(name) if params == resolve_params(strategy) else None
        if reference is not None:
            matches, done = True, 0
            limit = n if reference_seqs is None else min(reference_seqs, n)
            with _Timer() as python_t:
                for i in range(limit):
                    shards = reference(lens[offsets[i]:offsets[i + 1]].tolist(), cp)
                    lo, hi = out[0][i], out[0][i + 1]
                    matches &= sorted(shards) == sorted(zip(*(a[lo:hi].tolist() for a in out[1:])))
                    done += 1
                    if reference_seqs is None and time.perf_counter() - python_t.wall > python_budget_s:
                        break
            row.update(python_seqs_per_s=done / python_t.wall, python_seqs_per_cpu_s=done / python_t.cpu,
                       python_seqs=done, speedup=numba_rate * python_t.wall / done,
                       kernel_speedup=row["kernel_seqs_per_cpu_s"] * python_t.cpu / done,
                       python_matches=bool(matches))
    return {"rows": rows, "cpus": os.cpu_count()}


def end_to_end(spec: str, cp: int, context_len: int, num_seqs: int, strategies: list[str],
               workers: list[int], seed: int) -> dict:
    """Seconds of ``synth --no-tokens``, ``plan`` per strategy and worker count, and ``verify``.

    The dataset: ``num_seqs`` sequences of distribution ``spec``, in a temporary folder.
    """
    from flashcp.data.synth import synth_dataset
    from flashcp.planner.pipeline import plan_dataset
    from flashcp.planner.verify import verify_dataset

    with tempfile.TemporaryDirectory(prefix="flashcp-speed-") as tmp:
        root = Path(tmp) / "data"
        started = time.perf_counter()
        synth_dataset(root, dist=spec, num_seqs=num_seqs, context_len=context_len, seed=seed, with_tokens=False)
        result: dict = {"source": spec, "cp": cp, "context_len": context_len, "num_seqs": num_seqs,
                        "synth_s": time.perf_counter() - started,
                        "bytes": sum(f.stat().st_size for f in (root / "data").iterdir()), "plans": []}
        for name in strategies:
            for count in workers:
                started = time.perf_counter()
                meta = plan_dataset(root, cp, name, workers=count, force=True, name=f"w{count}-{name}").meta
                elapsed = time.perf_counter() - started
                result["plans"].append({"strategy": name, "workers": count, "seconds": elapsed,
                                        "seqs_per_s": num_seqs / elapsed,
                                        "compared": meta["summary"]["compare"]["sequences"]})
        started = time.perf_counter()
        report = verify_dataset(root)
        result.update(verify_s=time.perf_counter() - started, verified_plans=len(report.plans))
    return result
