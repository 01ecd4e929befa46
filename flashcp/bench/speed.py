"""Scenario 2, planner speed: sequences per second of each strategy's Numba kernels and its Python reference.

All run in one process, one core, on the same sequences: ``plan_sequence`` one sequence at a time, the
batch pipeline ``plan_rows`` (one kernel call over all sequences, plans validated and metrics computed as
``flashcp plan`` does), and the plain-Python reference. The Numba kernels are compiled (or loaded from the
cache) on a first sequence that is not timed. The plain-Python references live in ``tests/naive.py``, so
that column exists only in a source checkout; it runs until ``python_budget_s`` is spent (at least one
sequence) and the bench checks that the reference's shards equal the kernel's.
"""

from __future__ import annotations

import importlib
import time

import numpy as np

from flashcp.bench.systems import PlanBook, plan_for

__all__ = ["naive_planner", "planner_speed"]


def naive_planner(strategy: str):
    """``tests.naive.naive_<strategy>`` (``+`` spelt ``_plus``) in a source checkout, else None."""
    try:
        naive = importlib.import_module("tests.naive")
    except ImportError:
        return None
    return getattr(naive, "naive_" + strategy.replace("+", "_plus"), None)


def _as_rows(plan) -> list[tuple[int, int, int, int]]:
    return sorted(zip(plan.shard_doc.tolist(), plan.shard_start.tolist(), plan.shard_len.tolist(),
                      plan.shard_rank.tolist()))


def _batch_rate(strategy: str, sequences, cp: int) -> float:
    """Sequences/s of ``pipeline.plan_rows`` (the batch kernel plus its validation) on all ``sequences``."""
    from flashcp.planner.pipeline import plan_rows

    offsets = np.r_[0, np.cumsum([s.size for s in sequences])].astype(np.int64)
    lens = np.concatenate(sequences).astype(np.int64)
    plan_rows(offsets[:2], lens[:offsets[1]], cp, strategy)  # compile or load outside the timing
    started = time.perf_counter()
    plan_rows(offsets, lens, cp, strategy)
    return len(sequences) / max(time.perf_counter() - started, 1e-9)


def planner_speed(book: PlanBook, source, strategies: list[str], cp: int, context_len: int, num_seqs: int,
                  python_budget_s: float = 5.0) -> dict:
    """Rows ``{strategy, numba_seqs_per_s, batch_seqs_per_s, python_seqs_per_s, speedup, python_matches}``."""
    c = source.dataset_context_len or context_len
    sequences = book.sequences(source, num_seqs, c)
    rows = []
    for strategy in strategies:
        plan_for(strategy, sequences[0], cp)  # compile or load the kernels outside the timing
        started = time.perf_counter()
        plans = [plan_for(strategy, doc_lens, cp) for doc_lens in sequences]
        numba_rate = len(sequences) / max(time.perf_counter() - started, 1e-9)
        row = {"source": source.label, "context_len": c, "cp": cp, "strategy": strategy,
               "num_seqs": len(sequences), "numba_seqs_per_s": numba_rate, "batch_seqs_per_s": None,
               "python_seqs_per_s": None, "python_seqs": 0, "speedup": None, "python_matches": None}
        if strategy != "ring":
            row["batch_seqs_per_s"] = _batch_rate(strategy, sequences, cp)
        reference = naive_planner(strategy)
        if reference is not None:
            matches, done = True, 0
            started = time.perf_counter()
            for doc_lens, plan in zip(sequences, plans):
                shards = reference([int(n) for n in doc_lens], cp)
                matches &= sorted(shards) == _as_rows(plan)
                done += 1
                if time.perf_counter() - started > python_budget_s:
                    break
            python_rate = done / max(time.perf_counter() - started, 1e-9)
            row.update(python_seqs_per_s=python_rate, python_seqs=done, speedup=numba_rate / python_rate,
                       python_matches=bool(matches))
        rows.append(row)
    return {"rows": rows}
