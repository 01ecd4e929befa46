"""The planning pipeline: read document lengths, plan, validate, write ``plans/<name>/``, summarise.

Reusable without the CLI: :func:`plan_dataset` plans a dataset folder (flat arrays of sequences are
``flashcp.planner.planning.plan_rows``'s). Work is split by data file: a job streams the file's row groups
through plan, validate and write (:class:`flashcp.planner.plan_writer.PlanFileWriter`, one plan row group per
data row group), so it holds one row group's plans at a time whatever the file's size; it keeps only
per-sequence metrics. ``workers > 1`` runs jobs in worker processes, and the output does not depend on the
number of workers. ``plan.json`` is written last into the staging folder, which then takes the place of
``plans/<name>/`` in one swap.

The summary compares the plan with the baselines on the same sequences (``flashcp.planner.compare``).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from flashcp.costmodel.comm import batch_node_received, node_receive_summary
from flashcp.costmodel.models import DEFAULT_MODEL, ModelSpec, as_model_spec
from flashcp.costmodel.shape import AttentionShape
from flashcp.data.dataset import Dataset, numpy_values
from flashcp.errors import FlashcpError
from flashcp.fileio import exit_with_parent
from flashcp.planner import batch
from flashcp.planner.compare import (
    BASELINES,
    COMPARE_DEFAULT,
    compare_rows,
    compare_summary,
    compared_names,
    joined_metrics,
    metrics_summary,
    step_params,
)
from flashcp.planner.params import (
    check_shape,
    kernel_args,
    model_params,
    objective_model,
    plan_gpus_per_node,
    resolve_params,
)
from flashcp.planner.plan_writer import PlanFileWriter, PlanSlot, plan_name, write_plan_json
from flashcp.planner.planning import check_rows, plan_flat, plan_rows
from flashcp.planner.registry import get_strategy

__all__ = [
    "FileJob",
    "FileResult",
    "PlanResult",
    "plan_data_file",
    "plan_dataset",
    "read_row_group_lens",
    "warm_up",
]

@dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """What ``plan_dataset`` did: the plan's plan.json, and whether it was there already."""

    meta: dict
    """The plan's plan.json (written now, or read from the existing plan)."""
    up_to_date: bool = False
    """True when the plan already existed, made from the same data with the same parameters: nothing was
    written."""


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
    shape: AttentionShape | None = None
    """The model shape every price uses (the plan's model's ``attention_shape()``); None: the parameters'."""


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
    names = compared_names(job.strategy) if job.compare_step else []
    model = objective_model(step_params(job.strategy, job.params), job.shape) if names else None
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
            planned = plan_rows(offsets, lens, job.cp, job.strategy, job.params, where=where, first_row=first,
                                shape=job.shape)
            writer.write(planned.table())
            metrics.append((planned.imbalance, planned.ag_comm_tokens, planned.a2a_comm_tokens))
            if node_received is not None:
                node_received.append(batch_node_received(planned.shard_offsets, planned.shard_doc,
                                                         planned.shard_start, planned.shard_len,
                                                         planned.shard_rank, job.cp, per_node))
            if names:
                rows = np.flatnonzero((job.first_row + first + np.arange(planned.num_rows)) % job.compare_step == 0)
                for name, values in compare_rows(job.strategy, job.cp, offsets, lens, planned, rows, model, where,
                                                 first).items():
                    compared[name].append(values)
            first += planned.num_rows
            del planned  # before the next row group is planned
        plan_file = writer.close()
    except BaseException:
        writer.abort()
        raise
    return FileResult(plan_file=plan_file, metrics=joined_metrics(metrics, 3),  # type: ignore[arg-type]
                       compared={name: joined_metrics(parts, 4) for name, parts in compared.items()},
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
        plan_flat(chosen, offsets, lens, job.cp, job.params, polish=False, shape=job.shape)
    if job.compare_step:
        model = objective_model(step_params(job.strategy, job.params), job.shape)
        for name in BASELINES:
            plan_rows(offsets, lens, job.cp, name).step_seconds(job.cp, model)


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
                 run_jobs: Callable | None = None, compare: int = COMPARE_DEFAULT,
                 model: ModelSpec | str | dict | None = None) -> PlanResult:
    """Plan every sequence of the dataset at ``root`` and write ``plans/<name>/``; returns its plan.json.

    ``name`` defaults to ``cp{N}-{strategy}`` and must be a plain folder name. An existing plan of that name
    made from the dataset as it is now with the same strategy, cp, parameters and ``compare``, intact, is
    kept as it is (``PlanResult.up_to_date``, nothing written); one made otherwise is refused unless
    ``force``. With ``force`` it is replaced only once the new one is complete (built beside it and
    swapped, :class:`flashcp.planner.plan_writer.PlanSlot`), so a failure leaves it byte-identical.
    ``progress(rows)`` is called as rows finish; ``on_note(sentence)`` hears of staging folders of killed runs
    that were cleaned up. ``overrides`` set the strategy's other parameters (``chunk_size``, ``effort``,
    ``profile``, ...). ``compare`` sequences at most, evenly spaced, are planned with the ``BASELINES`` too
    (0: none); the returned dict carries their summaries, each with its mean projected step time, under
    ``summary["baselines"]``, and the plan's own on the same sequences under ``summary["compare"]``.
    ``run_jobs(jobs, workers, progress)`` runs the per-file jobs elsewhere (``flashcp.engines.ray_plan``) and
    returns their results in order; by default they run here or in local worker processes.

    ``model`` (a ``ModelSpec``, a built-in name, a config path or a Hugging Face config, ``as_model_spec``;
    None: ``DEFAULT_MODEL``) is what every price is made for: ``flashcp2``'s objective (its shape parameters are set
    to the model's, and one given in ``overrides`` that differs is refused), ``seq_cost`` and the comparison.
    plan.json records it (``model``); a plan made for another model is a different request.
    """
    spec = as_model_spec(DEFAULT_MODEL if model is None else model)
    dataset = Dataset(root)
    if target_imbalance is not None and not (math.isfinite(target_imbalance) and target_imbalance >= 1):
        raise FlashcpError(f"--target-imbalance must be a finite number of at least 1.0, got {target_imbalance}")
    try:
        chosen = get_strategy(strategy)
        params = resolve_params(chosen, target_imbalance, **model_params(chosen, overrides or {}, spec))
        check_shape(dataset.context_len, cp, params)
        shape = spec.attention_shape()
        kernel_args(chosen, params, shape)  # reads the profile: a bad one fails before any work
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

    wanted = {"strategy": chosen.name, "cp": cp, "params": json.loads(json.dumps(params)), "compare": compare,
              "model": json.loads(json.dumps(spec.as_dict()))}
    with PlanSlot(dataset, name, force=force, wanted=lambda meta: _difference(meta, wanted)) as slot:
        notes = list(slot.notes)
        if slot.up_to_date is not None:
            for note in notes:
                (on_note or (lambda message: None))(note)
            return PlanResult(meta=slot.up_to_date, up_to_date=True)
        if any(batch.needs_compile(get_strategy(strategy_name))
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
                                     compare_step=step, staging=str(staging), shape=shape))
                first_row += data_file.rows
            results = (run_jobs or _run_jobs)(jobs, workers, progress)
            summary = _summary(results, dataset.context_len, cp, compare, step,
                               step_params(chosen.name, params), shape)
            meta = write_plan_json(staging, dataset=dataset, strategy=chosen.name, params=params, cp=cp,
                                   plan_files=[r.plan_file for r in results], summary=summary, name=name,
                                   model=spec.as_dict())
            slot.commit()
        except OSError as e:
            raise FlashcpError(f"cannot write plan '{name}' in {dataset.root}: {e.strerror or e}") from None
    return PlanResult(meta=meta)


def _difference(meta: dict, wanted: dict) -> str | None:
    """The first way an existing plan's plan.json differs from the plan ``wanted``, as a phrase (None: alike).

    ``wanted``: strategy, cp, params (as JSON reads them back), compare (plan.json's
    ``summary.compare.requested``) and model (``ModelSpec.as_dict()``; a plan made before plan.json recorded
    its model differs from every model).
    """
    summary = meta.get("summary")
    if meta.get("model") != wanted["model"]:
        old = meta.get("model")
        there = old.get("name") if isinstance(old, dict) else "none recorded (priced for H=32, H_kv=32, D=128)"
        return f"--model {there} there, {wanted['model']['name']} now"
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
             priced_by: dict, shape: AttentionShape) -> dict:
    """plan.json's ``summary``: the plan's metrics over every sequence, then the comparison.

    The comparison is ``compare.compare_summary``'s; a plan made for a topology adds its intra- and
    inter-node receive (``topology``).
    """
    summary = metrics_summary([r.metrics for r in results], context_len, cp)
    summary.update(compare_summary([r.compared for r in results], context_len, cp, compare, step, priced_by,
                                   shape))
    if results and all(r.node_received is not None for r in results):  # made for a topology
        summary["topology"] = node_receive_summary(np.concatenate([r.node_received for r in results]),
                                                   context_len, cp, results[0].gpus_per_node)
    return summary
