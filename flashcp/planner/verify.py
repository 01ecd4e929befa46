"""``verify``: re-hash a dataset's data files against its manifest and re-check every stored plan.

Every problem found is reported, not only the first: a data file that fails is skipped by the plan checks
that need it, and the other files and plans are still checked. ``fast`` checks only what every reader checks
at open (each data and plan file's size and Parquet footer fingerprint, and each plan's freshness).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flashcp.costmodel.objective import sequence_flops
from flashcp.data.dataset import REPLACE_OLD_DIR, Dataset
from flashcp.errors import FlashcpError
from flashcp.fileio import sha256_file
from flashcp.planner import check
from flashcp.planner.plan_reader import PLAN_JSON, PLANS_DIR, PlanStore
from flashcp.planner.planning import check_rows, describe_error

__all__ = ["VerifyReport", "verify_dataset"]

_STAGING = re.compile(r"\..+\.(old-)?\d+-[0-9a-f]{8}\.tmp")


@dataclass(kw_only=True, slots=True)
class VerifyReport:
    """What ``verify`` checked and every problem it found."""

    data_files: int = 0
    """Data files that match the manifest."""
    sequences: int = 0
    """Sequences in those files (document lengths checked unless ``fast``)."""
    plans: dict[str, int] = field(default_factory=dict)
    """Plan name -> number of sequence plans checked, for the plans without problems."""
    problems: list[str] = field(default_factory=list)
    """One sentence per problem found; empty when everything checks out."""
    warnings: list[str] = field(default_factory=list)
    """Things worth a look that are not errors (unfinished plan folders, staging leftovers)."""
    fast: bool = False
    """Only sizes and fingerprints were checked, not the full hashes and contents."""

    @property
    def ok(self) -> bool:
        """No problems."""
        return not self.problems

    def to_json(self) -> dict:
        """The machine-readable report."""
        return {"ok": self.ok, "fast": self.fast, "data_files": self.data_files, "sequences": self.sequences,
                "plans": self.plans, "problems": self.problems, "warnings": self.warnings}


def verify_dataset(root: str | Path, progress: Callable[[int], None] | None = None, *,
                   fast: bool = False) -> VerifyReport:
    """Check DATA end to end and report every problem in ``report.problems``.

    Raises FlashcpError only when DATA is not a dataset at all. Data: every file exists, matches its manifest
    sha256 (``fast``: size and footer fingerprint) and row count, and every row's document lengths are
    positive and sum to the context length. Plans: every ``plans/<name>/plan.json`` was made from the current
    data files (else stale), its plan files match their sha256 and row counts, and every row covers each
    token once, gives equal tokens, and stores the metrics the cost model recomputes.
    """
    dataset = Dataset(root, check_files=False)
    report = VerifyReport(fast=fast)
    doc_lens: list[tuple[np.ndarray, np.ndarray] | None] = []
    for index, data_file in enumerate(dataset.files):
        doc_lens.append(None)
        try:
            doc_lens[-1] = _verify_data_file(dataset, index, fast)
        except FlashcpError as e:
            report.problems.append(str(e))
            continue
        report.data_files += 1
        report.sequences += data_file.rows
        if progress:
            progress(data_file.rows)
    for leftover in (REPLACE_OLD_DIR, ".flashcp-replacement"):
        if (dataset.root / leftover).exists():
            report.warnings.append(f"{leftover} is left by an interrupted 'flashcp pack --force'; re-running that "
                                   "command finishes it")
    plans_root = dataset.root / PLANS_DIR
    folders = sorted(p for p in plans_root.iterdir() if p.is_dir()) if plans_root.is_dir() else []
    for folder in folders:
        if folder.name.startswith("."):
            if _STAGING.fullmatch(folder.name):
                report.warnings.append(f"plans/{folder.name} is a staging folder left by an interrupted plan; "
                                       "the next 'flashcp plan' of that name removes it")
            continue
        if not (folder / PLAN_JSON).is_file():
            report.warnings.append(f"plans/{folder.name} has no {PLAN_JSON} (an unfinished plan); ignored")
            continue
        try:
            store = PlanStore(dataset, folder.name)
            report.plans[folder.name] = _verify_plan(dataset, store, doc_lens, progress, fast)
        except _Unchecked:
            continue
        except FlashcpError as e:
            report.problems.append(str(e))
    return report


class _Unchecked(Exception):
    """A plan file whose data file failed its own checks (already reported)."""


def _verify_data_file(dataset: Dataset, index: int, fast: bool) -> tuple[np.ndarray, np.ndarray] | None:
    data_file = dataset.files[index]
    path = dataset.path(data_file)
    if not path.is_file():
        raise FlashcpError(f"data file {data_file.path} listed in the manifest is missing")
    problem = dataset.file_problem(data_file)
    if problem:
        raise FlashcpError(problem)
    if fast:
        return None
    if sha256_file(path) != data_file.sha256:
        raise FlashcpError(f"data file {data_file.path} does not match its sha256 in the manifest: it was "
                           "changed or is corrupt")
    offsets, lens = dataset.read_doc_lens(index)
    if offsets.size - 1 != data_file.rows:
        raise FlashcpError(f"data file {data_file.path} has {offsets.size - 1} rows but the manifest says "
                           f"{data_file.rows}")
    check_rows(offsets, lens, dataset.context_len, f"data file {data_file.path}")
    return offsets, lens


def _verify_plan(dataset: Dataset, store: PlanStore, doc_lens, progress, fast: bool) -> int:
    name = store.name
    plan_files = store.plan_files
    if len(plan_files) != len(dataset.files):
        raise FlashcpError(f"plan '{name}' lists {len(plan_files)} plan files for {len(dataset.files)} data "
                           "files")
    checked, unchecked = 0, False
    for index, entry in enumerate(plan_files):
        path = store.plan_path(index)
        where = f"plan '{name}', {entry['path']}"
        if not path.is_file():
            raise FlashcpError(f"{where} is missing")
        if fast:
            checked += int(entry["rows"])
            continue
        if sha256_file(path) != entry["sha256"]:
            raise FlashcpError(f"{where} does not match its sha256 in {PLAN_JSON}: it was changed or is "
                               "corrupt")
        if doc_lens[index] is None:  # its data file's problem is reported; this plan is not counted as ok
            unchecked = True
            continue
        flat = store.read_flat(index)
        offsets, lens = doc_lens[index]
        rows = offsets.size - 1
        if flat["shard_offsets"].size - 1 != rows:
            raise FlashcpError(f"{where} has {flat['shard_offsets'].size - 1} rows for the {rows} rows of "
                               f"{dataset.files[index].path}")
        slack = float(store.meta.get("params", {}).get("token_slack", 0.0) or 0.0)
        arrays = (offsets, lens, flat["shard_offsets"], flat["shard_doc"], flat["shard_start"], flat["shard_len"],
                  flat["shard_rank"], store.cp)
        # a plan made with token slack: ranks within its window of their quotas
        errors, imbalance, ag, a2a = check.check_batch(*arrays, slack)
        if errors.any():
            bad = int(np.flatnonzero(errors)[0])
            raise FlashcpError(f"{where}, row {bad}: the plan {describe_error(int(errors[bad]))}")
        for label, stored, recomputed, exact in (
                ("imbalance", flat["imbalance"], imbalance, False),
                ("all-gather comm", flat["ag_comm_tokens"], ag, True),
                ("exact-need comm", flat["a2a_comm_tokens"], a2a, True)):
            same = stored == recomputed if exact else np.isclose(stored, recomputed, rtol=1e-12, atol=0)
            if not same.all():
                bad = int(np.flatnonzero(~same)[0])
                raise FlashcpError(f"{where}, row {bad}: stored {label} {stored[bad]} differs from the "
                                   f"recomputed {recomputed[bad]}")
        if "seq_cost" in flat:  # plan files made before the column have none to check
            recomputed = sequence_flops(offsets, lens, store.cost_shape)
            same = np.isclose(flat["seq_cost"], recomputed, rtol=1e-12, atol=0)
            if not same.all():
                bad = int(np.flatnonzero(~same)[0])
                raise FlashcpError(f"{where}, row {bad}: stored sequence cost {flat['seq_cost'][bad]} differs "
                                   f"from the recomputed {recomputed[bad]}")
        checked += rows
        if progress:
            progress(rows)
    if unchecked:
        raise _Unchecked
    return checked


def plan_names(root: Path) -> list[str]:
    """Names of the finished plans (folders with a plan.json) of the dataset at ``root``."""
    plans = root / PLANS_DIR
    return sorted(p.parent.name for p in plans.glob(f"[!.]*/{PLAN_JSON}")) if plans.is_dir() else []


def read_plan_meta(root: Path, name: str) -> dict | None:
    """A plan's plan.json, or None when it is not readable as a JSON object."""
    try:
        meta = json.loads((root / PLANS_DIR / name / PLAN_JSON).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None
