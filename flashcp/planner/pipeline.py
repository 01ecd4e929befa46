"""The planning pipeline: read document lengths, plan, validate, summarise, write ``plans/<name>/``.

Reusable without the CLI: :func:`plan_dataset` plans a dataset folder, :func:`plan_rows` plans flat arrays
of sequences, :func:`strategy_metrics` returns per-sequence metrics for lists of ``doc_lens`` (the bench
uses it). Work is split by data file: a job plans a file's row groups one at a time, validates every plan and
writes the file's plan file into a staging folder; ``workers > 1`` runs jobs in worker processes, and the
output does not depend on the number of workers. ``plan.json`` is written last into the staging folder, which
then takes the place of ``plans/<name>/`` in one swap.
"""

from __future__ import annotations

import math
import multiprocessing
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from flashcp.data.dataset import Dataset, numpy_values
from flashcp.errors import FlashcpError, PlanError
from flashcp.planner import _batch
from flashcp.planner.cost import batch_node_received, comm_saving, exact_need_saving, node_receive_summary
from flashcp.planner.plan import SequencePlan
from flashcp.planner.polish import parse_effort, polish_plan
from flashcp.planner.store import (
    PlanSlot,
    plan_name,
    plan_table,
    write_plan_file,
    write_plan_json,
)
from flashcp.planner.strategies import (
    Strategy,
    check_shape,
    get_strategy,
    kernel_args,
    plan_gpus_per_node,
    resolve_params,
)

__all__ = [
    "BASELINES",
    "PlannedRows",
    "check_rows",
    "describe_error",
    "plan_dataset",
    "plan_rows",
    "read_row_group_lens",
    "strategy_metrics",
    "summarize",
]

BASELINES = ("llama3", "perdoc")
BASELINE_MAX_ROWS = 10_000
"""Baselines are summarised on at most this many evenly spaced sequences (Per-Doc plans are large)."""

_ERROR_TEXT = {
    _batch.NO_SHARDS: "has no shards",
    _batch.BAD_LENGTH: "has a shard shorter than 1 token",
    _batch.BAD_RANK: "names a rank outside [0, cp)",
    _batch.BAD_DOC: "names a document the sequence does not have",
    _batch.BAD_COVERAGE: "does not cover every token of every document exactly once",
    _batch.BAD_QUOTA: "does not give every rank its equal-token quota",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRows:
    """Plans of many sequences as flat arrays, with their metrics recomputed by the cost model."""

    shard_offsets: np.ndarray
    """(rows + 1,) int64, indexes the flat shard arrays by row."""
    shard_doc: np.ndarray
    """(num_shards,) int64."""
    shard_start: np.ndarray
    """(num_shards,) int64."""
    shard_len: np.ndarray
    """(num_shards,) int64."""
    shard_rank: np.ndarray
    """(num_shards,) int64."""
    imbalance: np.ndarray
    """(rows,) float64."""
    ag_comm_tokens: np.ndarray
    """(rows,) int64, all-gather critical path."""
    a2a_comm_tokens: np.ndarray
    """(rows,) int64, exact-need critical path."""

    def row(self, i: int, cp: int) -> SequencePlan:
        """Row ``i``'s plan."""
        lo, hi = self.shard_offsets[i], self.shard_offsets[i + 1]
        return SequencePlan(shard_doc=self.shard_doc[lo:hi], shard_start=self.shard_start[lo:hi],
                            shard_len=self.shard_len[lo:hi], shard_rank=self.shard_rank[lo:hi], cp=cp)


def describe_error(code: int) -> str:
    """The sentence ending for a :func:`flashcp.planner._batch.check_batch` error code."""
    return _ERROR_TEXT[code]


def check_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, context_len: int, where: str) -> None:
    """FlashcpError unless every row's document lengths are positive and sum to ``context_len``."""
    if row_offsets.size < 2:
        return
    if (doc_lens <= 0).any():
        raise FlashcpError(f"{where} holds a document of length 0 or less; re-create the dataset")
    counts = np.diff(row_offsets)
    if (counts == 0).any():
        bad = int(np.argmax(counts == 0))
        raise FlashcpError(f"{where}, row {bad}, has no documents; re-create the dataset")
    sums = np.add.reduceat(doc_lens, row_offsets[:-1])
    if (sums != context_len).any():
        bad = int(np.argmax(sums != context_len))
        raise FlashcpError(f"{where}, row {bad}: document lengths sum to {int(sums[bad])}, not the context "
                           f"length {context_len}; re-create the dataset")


def plan_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, strategy: str | Strategy,
              params: dict | None = None, *, where: str = "sequences") -> PlannedRows:
    """Plan every row of flat ``(row_offsets, doc_lens)``, validate the plans; PlanError names a bad row."""
    chosen = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    params = resolve_params(chosen) if params is None else params
    row_offsets = np.ascontiguousarray(row_offsets, dtype=np.int64)
    doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
    args = kernel_args(chosen, params)
    if chosen.rows is not None:  # planned in Python (dcp)
        offsets, doc, start, length, rank = chosen.rows(row_offsets, doc_lens, cp, params)
    else:
        offsets, doc, start, length, rank = _batch.plan_batch(row_offsets, doc_lens, cp, chosen.name, **args)
    ilp_seconds = parse_effort(params["effort"])[1] if "effort" in params else None
    if ilp_seconds is not None:
        offsets, doc, start, length, rank = _polish_rows(row_offsets, doc_lens, cp, args["model"], ilp_seconds,
                                                         offsets, doc, start, length, rank)
    slack = float(params.get("token_slack", 0.0))
    errors, imbalance, ag, a2a = _batch.check_batch(row_offsets, doc_lens, offsets, doc, start, length, rank, cp,
                                                    slack)
    if errors.any():
        bad = int(np.flatnonzero(errors)[0])
        raise PlanError(f"the {chosen.name} plan of {where}, row {bad}, {_ERROR_TEXT[int(errors[bad])]}")
    return PlannedRows(shard_offsets=offsets, shard_doc=doc, shard_start=start, shard_len=length,
                       shard_rank=rank, imbalance=imbalance, ag_comm_tokens=ag, a2a_comm_tokens=a2a)


def _polish_rows(row_offsets, doc_lens, cp, model, seconds, offsets, doc, start, length, rank):
    """``--effort ilp``: every row's plan polished with CP-SAT (``flashcp.planner.polish``)."""
    parts = []
    for i in range(row_offsets.size - 1):
        lo, hi = offsets[i], offsets[i + 1]
        plan = SequencePlan(shard_doc=doc[lo:hi], shard_start=start[lo:hi], shard_len=length[lo:hi],
                            shard_rank=rank[lo:hi], cp=cp)
        parts.append(polish_plan(doc_lens[row_offsets[i]:row_offsets[i + 1]], plan, model, seconds))
    new_offsets = np.zeros(len(parts) + 1, np.int64)
    new_offsets[1:] = np.cumsum([p.num_shards for p in parts])
    flat = [np.ascontiguousarray(np.concatenate([getattr(p, name) for p in parts]), dtype=np.int64)
            for name in ("shard_doc", "shard_start", "shard_len", "shard_rank")]
    return (new_offsets, *flat)


def strategy_metrics(sequences: Sequence[np.ndarray], cp: int, strategy: str,
                     target_imbalance: float | None = None, **overrides) -> dict[str, np.ndarray]:
    """Per-sequence ``imbalance``, ``ag_comm_tokens`` and ``a2a_comm_tokens`` of a strategy's plans.

    ``sequences`` is a list of ``doc_lens`` arrays; every plan is validated on the way.
    """
    chosen = get_strategy(strategy)
    lens = [np.asarray(s, dtype=np.int64) for s in sequences]
    row_offsets = np.zeros(len(lens) + 1, np.int64)
    row_offsets[1:] = np.cumsum([s.size for s in lens])
    flat = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    planned = plan_rows(row_offsets, flat, cp, chosen, resolve_params(chosen, target_imbalance, **overrides))
    return {"imbalance": planned.imbalance, "ag_comm_tokens": planned.ag_comm_tokens,
            "a2a_comm_tokens": planned.a2a_comm_tokens}


def summarize(imbalance: np.ndarray, ag: np.ndarray, a2a: np.ndarray, context_len: int, cp: int) -> dict:
    """Mean/p50/max imbalance and mean comm savings of a set of plans (plan.json ``summary``)."""
    if imbalance.size == 0:
        return {"sequences": 0}
    return {
        "sequences": int(imbalance.size),
        "imbalance_mean": float(imbalance.mean()),
        "imbalance_p50": float(np.median(imbalance)),
        "imbalance_max": float(imbalance.max()),
        "ag_comm_tokens_mean": float(ag.mean()),
        "a2a_comm_tokens_mean": float(a2a.mean()),
        "ag_saving_mean": comm_saving(float(ag.mean()), context_len, cp),
        "a2a_saving_mean": exact_need_saving(float(a2a.mean()), context_len, cp),
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class _FileJob:
    """One data file to plan; the worker writes its plan file into ``staging``."""

    root: str
    file_index: int
    first_row: int
    """Global index of the file's first sequence (for baseline sampling)."""
    cp: int
    strategy: str
    params: dict
    context_len: int
    baseline_step: int
    staging: str


@dataclass(frozen=True, kw_only=True, slots=True)
class _FileResult:
    plan_file: dict
    metrics: tuple[np.ndarray, np.ndarray, np.ndarray]
    baselines: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    node_received: np.ndarray | None = None  # (rows, 2) intra/inter-node receive under a topology
    gpus_per_node: int = 0


def _plan_file(job: _FileJob) -> _FileResult:
    """Plan every row group of one data file, validate, write its plan file; runs in worker processes too."""
    dataset = Dataset(job.root, check_files=False)  # the parent checked them
    where = f"data file {dataset.files[job.file_index].path}"
    parts, sampled = [], []
    first = job.first_row
    for group in range(dataset.parquet(job.file_index).num_row_groups):
        offsets, lens = read_row_group_lens(dataset, job.file_index, group)
        check_rows(offsets, lens, job.context_len, where)
        parts.append(plan_rows(offsets, lens, job.cp, job.strategy, job.params, where=where))
        sampled += [lens[offsets[i]:offsets[i + 1]] for i in range(offsets.size - 1)
                    if (first + i) % job.baseline_step == 0]
        first += offsets.size - 1
    rows = _concat(parts)
    table = plan_table(rows.shard_offsets, rows.shard_doc, rows.shard_start, rows.shard_len, rows.shard_rank,
                       rows.imbalance, rows.ag_comm_tokens, rows.a2a_comm_tokens)
    plan_file = write_plan_file(Path(job.staging), job.file_index, table)
    baselines = {}
    if sampled:
        sub_offsets = np.zeros(len(sampled) + 1, np.int64)
        sub_offsets[1:] = np.cumsum([s.size for s in sampled])
        for name in BASELINES:
            b = plan_rows(sub_offsets, np.concatenate(sampled), job.cp, name, where=where)
            baselines[name] = (b.imbalance, b.ag_comm_tokens, b.a2a_comm_tokens)
    metrics = (rows.imbalance, rows.ag_comm_tokens, rows.a2a_comm_tokens)
    per_node = plan_gpus_per_node(job.params)
    node_received = batch_node_received(rows.shard_offsets, rows.shard_doc, rows.shard_start, rows.shard_len,
                                        rows.shard_rank, job.cp, per_node) if 0 < per_node < job.cp else None
    return _FileResult(plan_file=plan_file, metrics=metrics, baselines=baselines, node_received=node_received,
                       gpus_per_node=per_node)


def read_row_group_lens(dataset: Dataset, file_index: int, row_group: int) -> tuple[np.ndarray, np.ndarray]:
    """``(row_offsets, doc_lens)`` of one row group of a data file; one-sentence FlashcpError if corrupt."""
    pf = dataset.parquet(file_index)
    try:
        column = pf.read_row_group(row_group, columns=["doc_lens"]).column("doc_lens").combine_chunks()
        offsets = numpy_values(column.offsets).astype(np.int64)
        values = numpy_values(column.values).astype(np.int64)
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError) as e:
        raise FlashcpError(f"data file {dataset.path(dataset.files[file_index])} is corrupt ({e}); "
                           "re-create the dataset") from None
    return offsets - offsets[0], values[offsets[0]:offsets[-1]]


def _concat(parts: list[PlannedRows]) -> PlannedRows:
    if not parts:  # a data file without rows
        empty = np.zeros(0, np.int64)
        return PlannedRows(shard_offsets=np.zeros(1, np.int64), shard_doc=empty, shard_start=empty,
                           shard_len=empty, shard_rank=empty, imbalance=np.zeros(0), ag_comm_tokens=empty,
                           a2a_comm_tokens=empty)
    offsets = [np.zeros(1, np.int64)]
    base = 0
    for p in parts:
        offsets.append(p.shard_offsets[1:] + base)
        base += int(p.shard_offsets[-1])
    cat = {name: np.concatenate([getattr(p, name) for p in parts])
           for name in ("shard_doc", "shard_start", "shard_len", "shard_rank", "imbalance", "ag_comm_tokens",
                        "a2a_comm_tokens")}
    return PlannedRows(shard_offsets=np.concatenate(offsets), **cat)


def plan_dataset(root: str | Path, cp: int, strategy: str = "flashcp", *,
                 target_imbalance: float | None = None, workers: int = 1, force: bool = False,
                 name: str | None = None, progress: Callable[[int], None] | None = None,
                 on_note: Callable[[str], None] | None = None, overrides: dict | None = None,
                 run_jobs: Callable | None = None) -> dict:
    """Plan every sequence of the dataset at ``root`` and write ``plans/<name>/``; returns its plan.json.

    ``name`` defaults to ``cp{N}-{strategy}`` and must be a plain folder name. An existing plan of that name
    is refused unless ``force``; it is then replaced only once the new one is complete (built beside it and
    swapped, :class:`flashcp.planner.store.PlanSlot`), so a failure leaves it byte-identical.
    ``progress(rows)`` is called as rows finish; ``on_note(sentence)`` hears of staging folders of killed runs
    that were cleaned up. ``overrides`` set the strategy's other parameters (``chunk_size``, ``effort``,
    ``profile``, ...). The returned dict carries the baselines' summaries under ``summary["baselines"]``.
    ``run_jobs(jobs, workers, progress)`` runs the per-file jobs elsewhere (``flashcp.engines.ray_plan``) and
    returns their results in order; by default they run here or in local worker processes.
    """
    dataset = Dataset(root)
    if target_imbalance is not None and not (math.isfinite(target_imbalance) and target_imbalance >= 1):
        raise FlashcpError(f"--target-imbalance must be a finite number of at least 1.0, got {target_imbalance}")
    try:
        chosen = get_strategy(strategy)
        params = resolve_params(chosen, target_imbalance, **(overrides or {}))
        check_shape(dataset.context_len, cp, params)
        kernel_args(chosen, params)  # reads the profile: a bad one fails before any work
    except ValueError as e:
        raise FlashcpError(str(e)) from None
    if workers < 1:
        raise FlashcpError(f"--workers must be at least 1, got {workers}")
    name = plan_name(cp, chosen.name) if name is None else name
    total_rows = dataset.num_sequences
    step = max(1, -(-total_rows // BASELINE_MAX_ROWS))
    for index, data_file in enumerate(dataset.files):
        rows = dataset.parquet(index).metadata.num_rows
        if rows != data_file.rows:
            raise FlashcpError(f"data file {data_file.path} has {rows} rows but the manifest says "
                               f"{data_file.rows}; re-create the dataset")

    with PlanSlot(dataset, name, force=force) as slot:
        notes = list(slot.notes)
        if any(_batch.needs_compile(strategy_name) for strategy_name in (chosen.name, *BASELINES)
               if get_strategy(strategy_name).kernel is not None):
            notes.append("compiling planner kernels, first run only")
        for note in notes:
            (on_note or (lambda message: None))(note)
        try:
            staging = slot.staging()
            jobs, first_row = [], 0
            for index, data_file in enumerate(dataset.files):
                jobs.append(_FileJob(root=str(dataset.root), file_index=index, first_row=first_row, cp=cp,
                                     strategy=chosen.name, params=params, context_len=dataset.context_len,
                                     baseline_step=step, staging=str(staging)))
                first_row += data_file.rows
            results = (run_jobs or _run_jobs)(jobs, workers, progress)
            summary = _summary(results, dataset.context_len, cp, step)
            meta = write_plan_json(staging, dataset=dataset, strategy=chosen.name, params=params, cp=cp,
                                   plan_files=[r.plan_file for r in results], summary=summary, name=name)
            slot.commit()
        except OSError as e:
            raise FlashcpError(f"cannot write plan '{name}' in {dataset.root}: {e.strerror or e}") from None
    return meta


def _run_jobs(jobs: list[_FileJob], workers: int,
              progress: Callable[[int], None] | None) -> list[_FileResult]:
    results: list[_FileResult] = []
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            results.append(_plan_file(job))
            if progress:
                progress(int(results[-1].metrics[0].size))
        return results
    # fork (Linux) hands workers the parent's loaded kernels at no cost; spawn re-imports and reloads the
    # compiled kernels in every worker (seconds). The parent has only read Parquet footers at this point.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context) as pool:
        for result in pool.map(_plan_file, jobs):
            results.append(result)
            if progress:
                progress(int(result.metrics[0].size))
    return results


def _summary(results: list[_FileResult], context_len: int, cp: int, step: int) -> dict:
    def joined(metrics: list) -> dict:
        imbalance, ag, a2a = (np.concatenate(x) for x in zip(*metrics))
        return summarize(imbalance, ag, a2a, context_len, cp)

    summary = joined([r.metrics for r in results])
    baselines = {}
    for name in BASELINES:
        got = [r.baselines[name] for r in results if name in r.baselines]
        if got:
            baselines[name] = joined(got)
    summary["baselines"] = baselines
    summary["baselines_every_nth_sequence"] = step
    if results and all(r.node_received is not None for r in results):  # made for a topology
        summary["topology"] = node_receive_summary(np.concatenate([r.node_received for r in results]),
                                                   context_len, cp, results[0].gpus_per_node)
    return summary
