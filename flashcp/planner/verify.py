"""``verify``: re-hash a dataset's data files against its manifest and re-check every stored plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError, PlanError
from flashcp.fileio import sha256_file
from flashcp.planner import _batch
from flashcp.planner.pipeline import check_rows, describe_error
from flashcp.planner.store import PLAN_JSON, PLANS_DIR, PlanStore

__all__ = ["VerifyReport", "verify_dataset"]


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    """What ``verify`` checked (it raises on the first problem instead of reporting it)."""

    data_files: int = 0
    """Data files whose bytes match the manifest."""
    sequences: int = 0
    """Sequences whose document lengths sum to the context length."""
    plans: dict[str, int] = field(default_factory=dict)
    """Plan name -> number of sequence plans checked."""
    warnings: list[str] = field(default_factory=list)
    """Things worth a look that are not errors (unfinished plan folders)."""


def verify_dataset(root: str | Path, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check DATA end to end; raise FlashcpError (PlanError, StalePlanError) naming the first problem.

    Data: every file exists, matches its manifest sha256 and row count, and every row's document lengths
    are positive and sum to the context length. Plans: every ``plans/<name>/plan.json`` was made from the
    current data files (else stale), its plan files match their sha256 and row counts, and every row covers
    each token once, gives equal tokens, and stores the metrics the cost model recomputes.
    """
    dataset = Dataset(root)
    report = VerifyReport()
    doc_lens = []
    for index, data_file in enumerate(dataset.files):
        path = dataset.path(data_file)
        if not path.is_file():
            raise FlashcpError(f"data file {data_file.path} listed in the manifest is missing")
        if sha256_file(path) != data_file.sha256:
            raise FlashcpError(f"data file {data_file.path} does not match its sha256 in the manifest: it "
                               "was changed or is corrupt")
        offsets, lens = dataset.read_doc_lens(index)
        if offsets.size - 1 != data_file.rows:
            raise FlashcpError(f"data file {data_file.path} has {offsets.size - 1} rows but the manifest "
                               f"says {data_file.rows}")
        check_rows(offsets, lens, dataset.context_len, f"data file {data_file.path}")
        doc_lens.append((offsets, lens))
        report.data_files += 1
        report.sequences += data_file.rows
        if progress:
            progress(data_file.rows)
    plans_root = dataset.root / PLANS_DIR
    folders = sorted(p for p in plans_root.iterdir() if p.is_dir()) if plans_root.is_dir() else []
    for folder in folders:
        if folder.name.startswith("."):
            continue
        if not (folder / PLAN_JSON).is_file():
            report.warnings.append(f"plans/{folder.name} has no {PLAN_JSON} (an unfinished plan); ignored")
            continue
        report.plans[folder.name] = _verify_plan(dataset, PlanStore(dataset, folder.name), doc_lens, progress)
    return report


def _verify_plan(dataset: Dataset, store: PlanStore, doc_lens, progress) -> int:
    name = store.name
    plan_files = store.meta.get("plan_files", [])
    if len(plan_files) != len(dataset.files):
        raise FlashcpError(f"plan '{name}' lists {len(plan_files)} plan files for {len(dataset.files)} data "
                           "files")
    checked = 0
    for index, entry in enumerate(plan_files):
        path = store.plan_path(index)
        where = f"plan '{name}', {entry['path']}"
        if not path.is_file():
            raise FlashcpError(f"{where} is missing")
        if sha256_file(path) != entry["sha256"]:
            raise FlashcpError(f"{where} does not match its sha256 in {PLAN_JSON}: it was changed or is "
                               "corrupt")
        flat = store.read_flat(index)
        offsets, lens = doc_lens[index]
        rows = offsets.size - 1
        if flat["shard_offsets"].size - 1 != rows:
            raise FlashcpError(f"{where} has {flat['shard_offsets'].size - 1} rows for the {rows} rows of "
                               f"{dataset.files[index].path}")
        errors, imbalance, ag, a2a = _batch.check_batch(
            offsets, lens, flat["shard_offsets"], flat["shard_doc"], flat["shard_start"], flat["shard_len"],
            flat["shard_rank"], store.cp)
        if errors.any():
            bad = int(np.flatnonzero(errors)[0])
            raise PlanError(f"{where}, row {bad}: the plan {describe_error(int(errors[bad]))}")
        for label, stored, recomputed, exact in (
                ("imbalance", flat["imbalance"], imbalance, False),
                ("all-gather comm", flat["ag_comm_tokens"], ag, True),
                ("exact-need comm", flat["a2a_comm_tokens"], a2a, True)):
            same = stored == recomputed if exact else np.isclose(stored, recomputed, rtol=1e-12, atol=0)
            if not same.all():
                bad = int(np.flatnonzero(~same)[0])
                raise PlanError(f"{where}, row {bad}: stored {label} {stored[bad]} differs from the "
                                f"recomputed {recomputed[bad]}")
        checked += rows
        if progress:
            progress(rows)
    return checked
