"""The planning pipeline: read document lengths, plan, validate, write ``plans/<name>/``, summarise.

Reusable without the CLI: :func:`plan_dataset` plans a dataset folder, :func:`plan_rows` plans flat arrays
of sequences, :func:`strategy_metrics` returns per-sequence metrics for lists of ``doc_lens`` (the bench
uses it). Work is split by data file: a job streams the file's row groups through plan, validate and write
(:class:`flashcp.planner.store.PlanFileWriter`, one plan row group per data row group), so it holds one
row group's plans at a time whatever the file's size; it keeps only per-sequence metrics. ``workers > 1``
runs jobs in worker processes, and the output does not depend on the number of workers. ``plan.json`` is
written last into the staging folder, which then takes the place of ``plans/<name>/`` in one swap.

The summary compares the plan with the baselines (``BASELINES``) on the same sequences: every ``step``-th
sequence of the dataset (``--compare N`` sequences at most, evenly spaced), each baseline planned one
sequence at a time and only its metrics kept; every compared plan is also priced by the step-time objective
(``flashcp.costmodel.objective``, the model of ``flashcp2`` and ``flashcp bench``).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from flashcp.costmodel.comm import batch_node_received, comm_saving, exact_need_saving, node_receive_summary
from flashcp.costmodel.objective import batch_step_seconds, sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.data.dataset import Dataset, numpy_values
from flashcp.errors import FlashcpError, PlanError
from flashcp.fileio import exit_with_parent
from flashcp.planner import batch, check
from flashcp.planner.plan import SequencePlan
from flashcp.planner.registry import (
    DEFAULT_STRATEGY,
    Strategy,
    check_shape,
    get_strategy,
    kernel_args,
    objective_model,
    plan_flat,
    plan_gpus_per_node,
    resolve_params,
)
from flashcp.planner.store import PlanFileWriter, PlanSlot, plan_name, plan_table, write_plan_json

__all__ = [
    "BASELINES",
    "FileJob",
    "FileResult",
    "COMPARE_DEFAULT",
    "PlanResult",
    "PlannedRows",
    "check_rows",
    "describe_error",
    "plan_data_file",
    "plan_dataset",
    "plan_rows",
    "read_row_group_lens",
    "step_params",
    "strategy_metrics",
    "summarize",
    "warm_up",
]

BASELINES = ("llama3", "perdoc")
"""What ``flashcp plan`` compares its plan with: Llama3 CP and Per-Doc CP."""
COMPARE_DEFAULT = 256
"""Sequences compared with the baselines by default (``--compare``), evenly spaced over the dataset.

The comparison reports a ratio of mean projected step times. On WLB-LLM lengths its bootstrap standard error
at 256 sequences is 1.6-3.8% (128K x cp 8 and 1M x cp 64; twice that at 64), well inside the gaps it reports
there (1.6x to 3.4x), while it costs 11-21 ms of CPU per sequence at 1M x cp 64 (a Per-Doc plan has 33,000
shards there): a few seconds per run, about a tenth of planning one default 8,192-row file (bench/RESULTS.md).
"""

_ERROR_TEXT = {
    check.NO_SHARDS: "has no shards",
    check.BAD_LENGTH: "has a shard shorter than 1 token",
    check.BAD_RANK: "names a rank outside [0, cp)",
    check.BAD_DOC: "names a document the sequence does not have",
    check.BAD_COVERAGE: "does not cover every token of every document exactly once",
    check.BAD_QUOTA: "does not give every rank its equal-token quota",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """What ``plan_dataset`` did: the plan's plan.json, and whether it was there already."""

    meta: dict
    """The plan's plan.json (written now, or read from the existing plan)."""
    up_to_date: bool = False
    """True when the plan already existed, made from the same data with the same parameters: nothing was
    written."""


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
    seq_cost: np.ndarray
    """(rows,) float64, each sequence's price (``objective.sequence_flops`` under the plan's shape)."""

    def row(self, i: int, cp: int) -> SequencePlan:
        """Row ``i``'s plan."""
        lo, hi = self.shard_offsets[i], self.shard_offsets[i + 1]
        return SequencePlan(shard_doc=self.shard_doc[lo:hi], shard_start=self.shard_start[lo:hi],
                            shard_len=self.shard_len[lo:hi], shard_rank=self.shard_rank[lo:hi], cp=cp)

    @property
    def num_rows(self) -> int:
        """Sequences planned."""
        return int(self.shard_offsets.size - 1)

    def take(self, rows: np.ndarray) -> PlannedRows:
        """The plans of ``rows`` (int indices, in that order) alone, copied."""
        rows = np.asarray(rows, dtype=np.int64)
        lo, hi = self.shard_offsets[rows], self.shard_offsets[rows + 1]
        offsets = np.zeros(rows.size + 1, np.int64)
        offsets[1:] = np.cumsum(hi - lo)
        index = np.repeat(lo - offsets[:-1], hi - lo) + np.arange(offsets[-1], dtype=np.int64)
        return PlannedRows(shard_offsets=offsets, shard_doc=self.shard_doc[index],
                           shard_start=self.shard_start[index], shard_len=self.shard_len[index],
                           shard_rank=self.shard_rank[index], imbalance=self.imbalance[rows],
                           ag_comm_tokens=self.ag_comm_tokens[rows], a2a_comm_tokens=self.a2a_comm_tokens[rows],
                           seq_cost=self.seq_cost[rows])

    def table(self):
        """The plans as a plan-file table (``flashcp.planner.store.PLAN_SCHEMA``)."""
        return plan_table(self.shard_offsets, self.shard_doc, self.shard_start, self.shard_len, self.shard_rank,
                          self.imbalance, self.ag_comm_tokens, self.a2a_comm_tokens, self.seq_cost)

    def step_seconds(self, cp: int, model: np.ndarray) -> np.ndarray:
        """(rows,) projected step time of every plan (``objective.batch_step_seconds``; ``model``: its vector)."""
        return batch_step_seconds(self.shard_offsets, self.shard_doc, self.shard_start, self.shard_len,
                                  self.shard_rank, cp, model)


def describe_error(code: int) -> str:
    """The sentence ending for a :func:`flashcp.planner.check.check_batch` error code."""
    return _ERROR_TEXT[code]


def check_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, context_len: int, where: str, *,
               first_row: int = 0) -> None:
    """FlashcpError unless every row's document lengths are positive and sum to ``context_len``.

    Rows are named ``first_row`` + their index (their row in the data file).
    """
    if row_offsets.size < 2:
        return
    if (doc_lens <= 0).any():
        raise FlashcpError(f"{where} holds a document of length 0 or less; re-create the dataset")
    counts = np.diff(row_offsets)
    if (counts == 0).any():
        bad = first_row + int(np.argmax(counts == 0))
        raise FlashcpError(f"{where}, row {bad}, has no documents; re-create the dataset")
    sums = np.add.reduceat(doc_lens, row_offsets[:-1])
    if (sums != context_len).any():
        bad = int(np.argmax(sums != context_len))
        raise FlashcpError(f"{where}, row {first_row + bad}: document lengths sum to {int(sums[bad])}, not the context "
                           f"length {context_len}; re-create the dataset")


def plan_rows(row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, strategy: str | Strategy,
              params: dict | None = None, *, where: str = "sequences", first_row: int = 0) -> PlannedRows:
    """Plan every row of flat ``(row_offsets, doc_lens)``, validate the plans; PlanError names a bad row.

    Rows are named ``first_row`` + their index.
    """
    chosen = strategy if isinstance(strategy, Strategy) else get_strategy(strategy)
    params = resolve_params(chosen) if params is None else params
    row_offsets = np.ascontiguousarray(row_offsets, dtype=np.int64)
    doc_lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
    offsets, doc, start, length, rank = plan_flat(chosen, row_offsets, doc_lens, cp, params)
    slack = float(params.get("token_slack", 0.0))
    errors, imbalance, ag, a2a = check.check_batch(row_offsets, doc_lens, offsets, doc, start, length, rank, cp,
                                                    slack)
    if errors.any():
        bad = int(np.flatnonzero(errors)[0])
        raise PlanError(f"the {chosen.name} plan of {where}, row {first_row + bad}, "
                        f"{_ERROR_TEXT[int(errors[bad])]}")
    return PlannedRows(shard_offsets=offsets, shard_doc=doc, shard_start=start, shard_len=length,
                       shard_rank=rank, imbalance=imbalance, ag_comm_tokens=ag, a2a_comm_tokens=a2a,
                       seq_cost=sequence_flops(row_offsets, doc_lens, AttentionShape.from_params(params)))


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


def step_params(strategy: str, params: dict) -> dict:
    """The objective parameters (profile, model shape) the comparison prices plans with.

    A plan's own for a strategy that minimises the step time (``flashcp2``), else ``flashcp2``'s defaults (the
    bench's H100 profile, one layer of H = H_kv = 32, D = 128), so every row of a comparison has one price.
    """
    if "model" in get_strategy(strategy).kernel_params:
        return params
    return get_strategy(DEFAULT_STRATEGY).defaults


@dataclass(frozen=True, kw_only=True, slots=True)
class FileJob:
    """One data file to plan; the worker writes its plan file into ``staging``."""

    root: str
    file_index: int
    first_row: int
    """Global index of the file's first sequence (for picking the compared sequences)."""
    cp: int
    strategy: str
    params: dict
    context_len: int
    compare_step: int
    """Every ``compare_step``-th sequence of the dataset is compared with the baselines; 0: none is."""
    staging: str


@dataclass(frozen=True, kw_only=True, slots=True)
class FileResult:
    """What a file's job returns: its plan.json entry and its rows' metrics."""

    plan_file: dict
    metrics: tuple[np.ndarray, np.ndarray, np.ndarray]
    """(imbalance, all-gather, exact-need) of every row."""
    compared: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    """Strategy name -> (imbalance, all-gather, exact-need, step seconds) of the compared rows: the plan's
    strategy first, then ``BASELINES``."""
    node_received: np.ndarray | None = None
    """(rows, 2) intra- and inter-node receive of every row, for a plan made for a topology."""
    gpus_per_node: int = 0


def plan_data_file(job: FileJob) -> FileResult:
    """Plan one data file a row group at a time: plan, validate, write, compare; runs in worker processes too.

    A row group's plans are written and dropped before the next row group is read, so at most one row group's
    plans (and one baseline sequence's) are held at any time.
    """
    dataset = Dataset(job.root, check_files=False)  # the parent checked them
    where = f"data file {dataset.files[job.file_index].path}"
    names = _compared_names(job.strategy) if job.compare_step else []
    model = objective_model(step_params(job.strategy, job.params)) if names else None
    metrics: list[tuple] = []
    compared: dict[str, list[tuple]] = {name: [] for name in names}
    per_node = plan_gpus_per_node(job.params)
    node_received: list[np.ndarray] | None = [] if 0 < per_node < job.cp else None
    warm_up(job)
    first = 0  # the row group's first row in the file
    writer = PlanFileWriter(Path(job.staging), job.file_index, job.cp)
    try:
        for group in range(dataset.parquet(job.file_index).num_row_groups):
            offsets, lens = read_row_group_lens(dataset, job.file_index, group)
            check_rows(offsets, lens, job.context_len, where, first_row=first)
            planned = plan_rows(offsets, lens, job.cp, job.strategy, job.params, where=where, first_row=first)
            writer.write(planned.table())
            metrics.append((planned.imbalance, planned.ag_comm_tokens, planned.a2a_comm_tokens))
            if node_received is not None:
                node_received.append(batch_node_received(planned.shard_offsets, planned.shard_doc,
                                                         planned.shard_start, planned.shard_len,
                                                         planned.shard_rank, job.cp, per_node))
            if names:
                rows = np.flatnonzero((job.first_row + first + np.arange(planned.num_rows)) % job.compare_step == 0)
                for name, values in _compare(job, offsets, lens, planned, rows, model, where, first).items():
                    compared[name].append(values)
            first += planned.num_rows
            del planned  # before the next row group is planned
        plan_file = writer.close()
    except BaseException:
        writer.abort()
        raise
    return FileResult(plan_file=plan_file, metrics=_joined(metrics, 3),  # type: ignore[arg-type]
                       compared={name: _joined(parts, 4) for name, parts in compared.items()},
                       node_received=None if node_received is None else
                       np.concatenate(node_received) if node_received else np.zeros((0, 2), np.int64),
                       gpus_per_node=per_node)


def warm_up(job: FileJob) -> None:
    """Load (or compile) every kernel a job runs by planning (not polishing) and pricing a one-document sequence.

    Numba's first call of a strategy's batch kernel goes through its dispatcher, which leaves a reference
    cycle holding that call's frames, and so its plans, until the cyclic collector runs; made on a tiny
    sequence here, it holds nothing large. Also run by ``flashcp.engines.ray_plan`` before any task starts.
    """
    offsets, lens = np.array([0, 1], np.int64), np.array([job.context_len], np.int64)
    chosen = get_strategy(job.strategy)
    if chosen.kernel is not None:  # a strategy planned in Python (dcp) has nothing to load
        batch.plan_batch(offsets, lens, job.cp, job.strategy, **kernel_args(chosen, job.params))
    if job.compare_step:
        model = objective_model(step_params(job.strategy, job.params))
        for name in BASELINES:
            plan_rows(offsets, lens, job.cp, name).step_seconds(job.cp, model)


def _compared_names(strategy: str) -> list[str]:
    return [strategy] + [name for name in BASELINES if name != strategy]


def _compare(job: FileJob, offsets: np.ndarray, lens: np.ndarray, planned: PlannedRows, rows: np.ndarray,
             model: np.ndarray | None, where: str, first: int) -> dict[str, tuple]:
    """(imbalance, all-gather, exact-need, step seconds) of ``rows`` of a row group, per compared strategy.

    The plan's own rows are priced as planned; each baseline plans one row at a time (a Per-Doc plan of a
    long sequence is large), validated like every plan, and keeps its metrics only. A baseline that is the
    plan's strategy is the plan itself.
    """
    assert model is not None
    own = planned.take(rows)
    out = {job.strategy: (own.imbalance, own.ag_comm_tokens, own.a2a_comm_tokens, own.step_seconds(job.cp, model))}
    del own
    for name in BASELINES:
        if name == job.strategy:
            continue
        values = np.zeros((4, rows.size))
        for j, i in enumerate(rows):
            one_offsets = np.array([0, offsets[i + 1] - offsets[i]], np.int64)
            one = plan_rows(one_offsets, lens[offsets[i]:offsets[i + 1]], job.cp, name, where=where,
                            first_row=first + int(i))
            values[:, j] = one.imbalance[0], one.ag_comm_tokens[0], one.a2a_comm_tokens[0], \
                one.step_seconds(job.cp, model)[0]
        out[name] = (values[0], values[1].astype(np.int64), values[2].astype(np.int64), values[3])
    return out


def _joined(parts: list[tuple], width: int) -> tuple:
    """The per-row-group metric tuples of ``parts`` joined into one tuple of ``width`` arrays."""
    if not parts:
        return (np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))[:width]
    return tuple(np.concatenate(column) for column in zip(*parts))


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


def plan_dataset(root: str | Path, cp: int, strategy: str = "flashcp", *,
                 target_imbalance: float | None = None, workers: int = 1, force: bool = False,
                 name: str | None = None, progress: Callable[[int], None] | None = None,
                 on_note: Callable[[str], None] | None = None, overrides: dict | None = None,
                 run_jobs: Callable | None = None, compare: int = COMPARE_DEFAULT) -> PlanResult:
    """Plan every sequence of the dataset at ``root`` and write ``plans/<name>/``; returns its plan.json.

    ``name`` defaults to ``cp{N}-{strategy}`` and must be a plain folder name. An existing plan of that name
    made from the dataset as it is now with the same strategy, cp, parameters and ``compare``, intact, is
    kept as it is (``PlanResult.up_to_date``, nothing written); one made otherwise is refused unless
    ``force``. With ``force`` it is replaced only once the new one is complete (built beside it and
    swapped, :class:`flashcp.planner.store.PlanSlot`), so a failure leaves it byte-identical.
    ``progress(rows)`` is called as rows finish; ``on_note(sentence)`` hears of staging folders of killed runs
    that were cleaned up. ``overrides`` set the strategy's other parameters (``chunk_size``, ``effort``,
    ``profile``, ...). ``compare`` sequences at most, evenly spaced, are planned with the ``BASELINES`` too
    (0: none); the returned dict carries their summaries, each with its mean projected step time, under
    ``summary["baselines"]``, and the plan's own on the same sequences under ``summary["compare"]``.
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
    if isinstance(compare, bool) or not isinstance(compare, int) or compare < 0:
        raise FlashcpError(f"--compare must be a whole number of sequences, 0 or more, got {compare}")
    name = plan_name(cp, chosen.name) if name is None else name
    step = max(1, -(-dataset.num_sequences // compare)) if compare else 0
    for index, data_file in enumerate(dataset.files):
        rows = dataset.parquet(index).metadata.num_rows
        if rows != data_file.rows:
            raise FlashcpError(f"data file {data_file.path} has {rows} rows but the manifest says "
                               f"{data_file.rows}; re-create the dataset")

    wanted = {"strategy": chosen.name, "cp": cp, "params": json.loads(json.dumps(params)), "compare": compare}
    with PlanSlot(dataset, name, force=force, wanted=lambda meta: _difference(meta, wanted)) as slot:
        notes = list(slot.notes)
        if slot.up_to_date is not None:
            for note in notes:
                (on_note or (lambda message: None))(note)
            return PlanResult(meta=slot.up_to_date, up_to_date=True)
        if any(batch.needs_compile(strategy_name)
               for strategy_name in (chosen.name, *(BASELINES if compare else ()))
               if get_strategy(strategy_name).kernel is not None):
            notes.append("compiling planner kernels, first run only")
        for note in notes:
            (on_note or (lambda message: None))(note)
        try:
            staging = slot.staging()
            jobs, first_row = [], 0
            for index, data_file in enumerate(dataset.files):
                jobs.append(FileJob(root=str(dataset.root), file_index=index, first_row=first_row, cp=cp,
                                     strategy=chosen.name, params=params, context_len=dataset.context_len,
                                     compare_step=step, staging=str(staging)))
                first_row += data_file.rows
            results = (run_jobs or _run_jobs)(jobs, workers, progress)
            summary = _summary(results, dataset.context_len, cp, compare, step,
                               step_params(chosen.name, params))
            meta = write_plan_json(staging, dataset=dataset, strategy=chosen.name, params=params, cp=cp,
                                   plan_files=[r.plan_file for r in results], summary=summary, name=name)
            slot.commit()
        except OSError as e:
            raise FlashcpError(f"cannot write plan '{name}' in {dataset.root}: {e.strerror or e}") from None
    return PlanResult(meta=meta)


def _difference(meta: dict, wanted: dict) -> str | None:
    """The first way an existing plan's plan.json differs from the plan ``wanted``, as a phrase (None: alike).

    ``wanted``: strategy, cp, params (as JSON reads them back) and compare (plan.json's
    ``summary.compare.requested``).
    """
    summary = meta.get("summary")
    made = {"strategy": meta.get("strategy"), "cp": meta.get("cp"), "params": meta.get("params"),
            "compare": (summary.get("compare") or {}).get("requested") if isinstance(summary, dict) else None}
    for key in ("strategy", "cp", "compare"):
        if made[key] != wanted[key]:
            return f"--{key} {made[key]} there, {wanted[key]} now"
    old = made["params"] if isinstance(made["params"], dict) else {}
    for key in sorted(set(old) | set(wanted["params"])):
        if old.get(key) != wanted["params"].get(key):
            return f"--{key.replace('_', '-')} {old.get(key)} there, {wanted['params'].get(key)} now"
    return None


def _run_jobs(jobs: list[FileJob], workers: int,
              progress: Callable[[int], None] | None) -> list[FileResult]:
    results: list[FileResult] = []
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            results.append(plan_data_file(job))
            if progress:
                progress(int(results[-1].metrics[0].size))
        return results
    # fork (Linux) hands workers the parent's loaded kernels at no cost; spawn re-imports and reloads the
    # compiled kernels in every worker (seconds). The parent has only read Parquet footers at this point.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=context,
                                 initializer=exit_with_parent, initargs=(os.getpid(),)) as pool:
            for result in pool.map(plan_data_file, jobs):
                results.append(result)
                if progress:
                    progress(int(result.metrics[0].size))
    except BrokenProcessPool:
        raise FlashcpError("a planning worker process died (killed, or out of memory?), so nothing was "
                           "written; run the command again, with fewer --workers if memory is short") from None
    return results


def _summary(results: list[FileResult], context_len: int, cp: int, compare: int, step: int,
             priced_by: dict) -> dict:
    """plan.json's ``summary``: the plan's metrics over every sequence, then the comparison.

    ``baselines`` (name -> metrics, ``step_seconds_mean`` included) and ``baselines_every_nth_sequence`` (0:
    no comparison) as before; ``compare``: how many sequences were compared, the price's profile and model
    shape, and the plan's own metrics on those sequences (``strategy``).
    """
    def joined(parts: list[tuple]) -> dict:
        columns = [np.concatenate(column) for column in zip(*parts)]
        out = summarize(columns[0], columns[1], columns[2], context_len, cp)
        if len(columns) > 3 and columns[0].size:
            out["step_seconds_mean"] = float(columns[3].mean())
        return out

    summary = joined([r.metrics for r in results])
    names = list(results[0].compared) if results else []
    compared = {name: joined([r.compared[name] for r in results]) for name in names}
    summary["baselines"] = {name: compared[name] for name in BASELINES if name in compared}
    summary["baselines_every_nth_sequence"] = step
    summary["compare"] = {"requested": compare, "sequences": compared[names[0]]["sequences"] if names else 0,
                          "every_nth_sequence": step}
    if names:
        from flashcp.costmodel.profile import load_profile

        summary["compare"].update(
            profile=load_profile(priced_by.get("profile")).name,
            model={key: int(priced_by.get(key, default)) for key, default in
                   (("num_heads", 32), ("num_kv_heads", 32), ("head_dim", 128), ("layers", 1))},
            strategy=compared[names[0]])
    if results and all(r.node_received is not None for r in results):  # made for a topology
        summary["topology"] = node_receive_summary(np.concatenate([r.node_received for r in results]),
                                                   context_len, cp, results[0].gpus_per_node)
    return summary
