"""Plans on disk: ``DATA/plans/<name>/part-NNNNN.parquet`` (one per data file, same row order) + ``plan.json``.

``plan.json`` is written last; a plan exists once it exists. It records the sha256 of every data file the plan
was made from: a reader whose dataset's manifest lists other hashes refuses the plan as stale.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flashcp import __version__
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError, StalePlanError
from flashcp.fileio import sha256_file, write_json_atomic, write_parquet_atomic
from flashcp.planner.plan import SequencePlan

__all__ = [
    "PLAN_SCHEMA",
    "PlanStore",
    "StoredPlan",
    "plan_name",
    "plan_table",
    "write_plan_file",
    "write_plan_json",
]

PLAN_FORMAT_VERSION = 1
PLANS_DIR = "plans"
PLAN_JSON = "plan.json"
PLAN_ROW_GROUP_ROWS = 4096

PLAN_SCHEMA = pa.schema([
    ("shard_doc", pa.list_(pa.int32())),
    ("shard_start", pa.list_(pa.int32())),
    ("shard_len", pa.list_(pa.int32())),
    ("shard_rank", pa.list_(pa.int16())),
    ("imbalance", pa.float64()),
    ("ag_comm_tokens", pa.int64()),
    ("a2a_comm_tokens", pa.int64()),
])


def plan_name(cp: int, strategy: str) -> str:
    """The default plan folder name, e.g. ``cp8-flashcp``."""
    return f"cp{cp}-{strategy}"


def plan_table(shard_offsets: np.ndarray, shard_doc: np.ndarray, shard_start: np.ndarray,
               shard_len: np.ndarray, shard_rank: np.ndarray, imbalance: np.ndarray,
               ag_comm_tokens: np.ndarray, a2a_comm_tokens: np.ndarray) -> pa.Table:
    """Build a plan table from flat shard arrays; ``shard_offsets`` (rows + 1,) indexes them by row."""
    offsets = pa.array(shard_offsets, pa.int32())

    def column(values, value_type):
        return pa.ListArray.from_arrays(offsets, pa.array(values, value_type))

    return pa.table({
        "shard_doc": column(shard_doc, pa.int32()),
        "shard_start": column(shard_start, pa.int32()),
        "shard_len": column(shard_len, pa.int32()),
        "shard_rank": column(shard_rank, pa.int16()),
        "imbalance": pa.array(imbalance, pa.float64()),
        "ag_comm_tokens": pa.array(ag_comm_tokens, pa.int64()),
        "a2a_comm_tokens": pa.array(a2a_comm_tokens, pa.int64()),
    }, schema=PLAN_SCHEMA)


def write_plan_file(plan_dir: Path, index: int, table: pa.Table) -> dict:
    """Write the plan file matching the ``index``-th data file, atomically; return its plan.json entry."""
    path = plan_dir / f"part-{index:05d}.parquet"
    write_parquet_atomic(path, table, PLAN_ROW_GROUP_ROWS)
    return {"path": path.name, "rows": table.num_rows, "sha256": sha256_file(path)}


def write_plan_json(plan_dir: Path, *, dataset: Dataset, strategy: str, params: dict, cp: int,
                    plan_files: list[dict], summary: dict) -> dict:
    """Write ``plan.json`` last, atomically, and return it."""
    meta = {
        "format": "flashcp-plan",
        "format_version": PLAN_FORMAT_VERSION,
        "flashcp_version": __version__,
        "name": plan_dir.name,
        "strategy": strategy,
        "params": params,
        "cp": int(cp),
        "context_len": dataset.context_len,
        "data_files": [{"path": f.path, "sha256": f.sha256} for f in dataset.files],
        "plan_files": plan_files,
        "summary": summary,
    }
    write_json_atomic(plan_dir / PLAN_JSON, meta)
    return meta


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredPlan:
    """One sequence's plan as read from disk, with its stored metrics."""

    plan: SequencePlan
    """The shards."""
    imbalance: float
    """Stored imbalance ratio."""
    ag_comm_tokens: int
    """Stored all-gather critical path."""
    a2a_comm_tokens: int
    """Stored exact-need critical path."""


class PlanStore:
    """A plan folder of a dataset, opened for reading; refuses a missing, unfinished or stale plan."""

    def __init__(self, dataset: Dataset, name: str):
        self.dataset = dataset
        self.name = name
        self.dir = dataset.root / PLANS_DIR / name
        meta_path = self.dir / PLAN_JSON
        if not meta_path.is_file():
            available = sorted(p.parent.name for p in (dataset.root / PLANS_DIR).glob(f"*/{PLAN_JSON}"))
            hint = f"available: {', '.join(available)}" if available else "run 'flashcp plan' first"
            raise FlashcpError(f"plan '{name}' does not exist in {dataset.root} ({hint})")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FlashcpError(f"{meta_path} is not readable JSON ({e})") from None
        self.cp: int = int(self.meta["cp"])
        self.strategy: str = self.meta["strategy"]
        self.check_fresh()

    def check_fresh(self) -> None:
        """Raise StalePlanError unless the plan was made from the data files the manifest lists now."""
        planned = [(f["path"], f["sha256"]) for f in self.meta["data_files"]]
        current = [(f.path, f.sha256) for f in self.dataset.files]
        if planned != current or self.meta["context_len"] != self.dataset.context_len:
            raise StalePlanError(f"plan '{self.name}' is stale: it was made from other data files than "
                                 f"{self.dataset.root} holds now; re-run 'flashcp plan' (with --force)")

    def plan_path(self, index: int) -> Path:
        """Path of the plan file matching the ``index``-th data file."""
        return self.dir / self.meta["plan_files"][index]["path"]

    def read_flat(self, index: int) -> dict[str, np.ndarray]:
        """The whole ``index``-th plan file as flat int64/float64 arrays.

        Keys: ``shard_offsets`` (rows + 1,) indexing the flat ``shard_doc``, ``shard_start``, ``shard_len``,
        ``shard_rank``; and per row ``imbalance``, ``ag_comm_tokens``, ``a2a_comm_tokens``.
        """
        path = self.plan_path(index)
        try:
            table = pq.read_table(path, schema=PLAN_SCHEMA)
        except (OSError, pa.ArrowException) as e:
            raise FlashcpError(f"plan file {path} cannot be read ({e}); "
                               "re-run 'flashcp plan --force'") from None
        out: dict[str, np.ndarray] = {}
        for name in ("shard_doc", "shard_start", "shard_len", "shard_rank"):
            column = table.column(name).combine_chunks()
            offsets = column.offsets.to_numpy().astype(np.int64)
            out[name] = column.values.to_numpy().astype(np.int64)[offsets[0]:offsets[-1]]
            if name == "shard_doc":
                out["shard_offsets"] = offsets - offsets[0]
            elif not np.array_equal(offsets - offsets[0], out["shard_offsets"]):
                raise FlashcpError(f"plan file {path} is corrupt: its shard columns have different lengths")
        out["imbalance"] = table.column("imbalance").to_numpy()
        out["ag_comm_tokens"] = table.column("ag_comm_tokens").to_numpy().astype(np.int64)
        out["a2a_comm_tokens"] = table.column("a2a_comm_tokens").to_numpy().astype(np.int64)
        return out

    def _open(self, index: int) -> pq.ParquetFile:
        path = self.plan_path(index)
        try:
            return pq.ParquetFile(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise FlashcpError(f"plan file {path} cannot be read ({e}); "
                               "re-run 'flashcp plan --force'") from None

    def iter_plans(self, index: int) -> Iterator[StoredPlan]:
        """Yield the stored plans of the ``index``-th data file's rows in row order, a row group at a time."""
        pf = self._open(index)
        for g in range(pf.num_row_groups):
            yield from _stored_plans(pf.read_row_group(g), self.cp)

    def read_plans(self, index: int, start: int, stop: int) -> list[StoredPlan]:
        """The stored plans of rows ``[start, stop)`` of the ``index``-th data file.

        Reads only the row groups that hold those rows.
        """
        pf = self._open(index)
        groups, first, offset = [], 0, 0
        for g in range(pf.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            if first < stop and first + rows > start:
                groups.append(g)
                if len(groups) == 1:
                    offset = start - first
            first += rows
        if stop > first or start < 0:
            raise FlashcpError(f"plan file {self.plan_path(index)} has {first} rows, rows {start}..{stop} "
                               "were asked for; re-run 'flashcp plan --force'")
        if not groups:
            return []
        table = pf.read_row_groups(groups)
        return list(_stored_plans(table.slice(offset, stop - start), self.cp))


def _stored_plans(table: pa.Table, cp: int) -> Iterator[StoredPlan]:
    cols = {name: table.column(name).combine_chunks() for name in PLAN_SCHEMA.names}
    shard_cols = ("shard_doc", "shard_start", "shard_len", "shard_rank")
    offsets = cols["shard_doc"].offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]  # a sliced table's offsets start mid-buffer; flatten() below honours the slice
    flat = {name: cols[name].flatten().to_numpy().astype(np.int64) for name in shard_cols}
    imbalance = cols["imbalance"].to_numpy()
    ag = cols["ag_comm_tokens"].to_numpy()
    a2a = cols["a2a_comm_tokens"].to_numpy()
    for i in range(table.num_rows):
        lo, hi = offsets[i], offsets[i + 1]
        plan = SequencePlan(shard_doc=flat["shard_doc"][lo:hi], shard_start=flat["shard_start"][lo:hi],
                            shard_len=flat["shard_len"][lo:hi], shard_rank=flat["shard_rank"][lo:hi], cp=cp)
        yield StoredPlan(plan=plan, imbalance=float(imbalance[i]), ag_comm_tokens=int(ag[i]),
                         a2a_comm_tokens=int(a2a[i]))
