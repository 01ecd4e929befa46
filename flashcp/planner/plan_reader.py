"""Reading plans: ``DATA/plans/<name>/part-NNNNN.parquet`` (one per data file, same row order) + ``plan.json``.

The plan format (``PLAN_SCHEMA``, ``plan.json``'s fields) and :class:`PlanStore`, which opens a plan folder for
reading and refuses a missing, unfinished, stale or damaged plan: what the runtime (``CPLoader``), the
integrations, ``verify``, ``show`` and ``ls`` read. ``plan.json`` records the sha256 of every data file the plan
was made from: a reader whose dataset's manifest lists other hashes refuses the plan as stale. Writing plans
is ``flashcp.planner.plan_writer``'s (the runtime never loads it).
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
from flashcp.costmodel.models import ModelError, ModelSpec
from flashcp.costmodel.objective import sequence_flops
from flashcp.costmodel.profile import HardwareProfile, profile_from_json
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import rank_tokens, slack_tokens, token_quotas
from flashcp.data.dataset import Dataset, numpy_values
from flashcp.errors import FlashcpError, PlanError, StalePlanError
from flashcp.fileio import check_plain_name, parquet_footer
from flashcp.planner.plan import SequencePlan, check_metrics

__all__ = [
    "CP_KEY",
    "PLANS_DIR",
    "PLAN_FORMAT_VERSION",
    "PLAN_JSON",
    "PLAN_SCHEMA",
    "SEQ_COST",
    "PlanStore",
    "StoredPlan",
    "recorded_profile",
]

PLAN_FORMAT_VERSION = 1
PLANS_DIR = "plans"
PLAN_JSON = "plan.json"

PLAN_SCHEMA = pa.schema([
    ("shard_doc", pa.list_(pa.int32())),
    ("shard_start", pa.list_(pa.int32())),
    ("shard_len", pa.list_(pa.int32())),
    ("shard_rank", pa.list_(pa.int16())),
    ("imbalance", pa.float64()),
    ("ag_comm_tokens", pa.int64()),
    ("a2a_comm_tokens", pa.int64()),
    ("seq_cost", pa.float64()),
])
SEQ_COST = "seq_cost"
"""The plan column of each sequence's price (``costmodel.objective.sequence_flops`` under the plan's shape);
plan files written before it have every other column and no ``seq_cost``, and readers compute it."""


CP_KEY = b"flashcp.cp"
"""Key of the plan's CP size in a plan file's footer metadata, which readers check against plan.json."""



def recorded_profile(meta: dict, where: str) -> HardwareProfile | None:
    """The hardware profile recorded in a plan.json ``meta``, or None.

    None: the plan was made without ``--profile``, or before plan.json recorded it. ``where`` names the
    plan.json in errors.
    """
    record = meta.get("profile")
    if record is None:
        return None
    content = record.get("content") if isinstance(record, dict) else None
    return profile_from_json(content, f"recorded in {where}")


_FIELD_TYPES: dict[str, tuple[type, str]] = {
    "format_version": (int, "a whole number"), "strategy": (str, "a string"), "cp": (int, "a whole number"),
    "context_len": (int, "a whole number"), "params": (dict, "an object"), "summary": (dict, "an object"),
    "data_files": (list, "a list"), "plan_files": (list, "a list"),
}
"""plan.json's fields and the JSON type each must have (readers index into them)."""


def _check_fields(meta: dict) -> None:
    """TypeError naming the first plan.json field of the wrong JSON type (a missing one is left to KeyError)."""
    for key, (kind, phrase) in _FIELD_TYPES.items():
        value = meta.get(key)
        if key in meta and (not isinstance(value, kind) or isinstance(value, bool)):
            raise TypeError(f"{key} is {json.dumps(value)[:40]}, not {phrase}")
    if meta.get("format_version", 1) < 1:
        raise TypeError(f"format_version is {meta['format_version']}, not a plan format version")
    for key in ("data_files", "plan_files"):
        if not all(isinstance(entry, dict) for entry in meta.get(key, [])):
            raise TypeError(f"an entry of {key} is not an object")
    if "params" in meta and "token_slack" in meta["params"]:
        slack = meta["params"]["token_slack"]
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not 0 <= slack < 1:
            raise TypeError(f"params.token_slack is {slack}, not a number in [0, 1)")


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
    seq_cost: float | None = None
    """Stored price of the sequence (FLOPs, ``PlanStore.cost_shape``); None in plan files made before it."""


class PlanStore:
    """A plan folder of a dataset, opened for reading; refuses a missing, unfinished or stale plan."""

    def __init__(self, dataset: Dataset, name: str, *, folder: Path | None = None):
        self.dataset = dataset
        self.name = name
        self.dir = folder or dataset.root / PLANS_DIR / name  # ``folder``: a plan being written, to read back
        meta_path = self.dir / PLAN_JSON
        if not meta_path.is_file():
            available = sorted(p.parent.name for p in (dataset.root / PLANS_DIR).glob(f"*/{PLAN_JSON}"))
            hint = f"available: {', '.join(available)}" if available else "run 'flashcp plan' first"
            raise FlashcpError(f"plan '{name}' does not exist in {dataset.root} ({hint})")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FlashcpError(f"{meta_path} is not readable JSON ({e})") from None
        version = self.meta.get("format_version", 1) if isinstance(self.meta, dict) else 1
        if isinstance(version, int) and not isinstance(version, bool) and version > PLAN_FORMAT_VERSION:
            raise FlashcpError(f"{meta_path} is plan format version {version}, written by a newer flashcp; this "
                               f"flashcp {__version__} reads version {PLAN_FORMAT_VERSION}: upgrade flashcp, or "
                               "re-run 'flashcp plan --force' with this one")
        try:
            if not isinstance(self.meta, dict):
                raise TypeError("it is not a JSON object")
            _check_fields(self.meta)
            self.cp: int = int(self.meta["cp"])
            self.strategy: str = str(self.meta["strategy"])
            self.context_len: int = int(self.meta["context_len"])
            self.data_files: list[tuple[str, str]] = [(str(f["path"]), str(f["sha256"]))
                                                      for f in self.meta["data_files"]]
            self.plan_files: list[dict] = list(self.meta["plan_files"])
            for entry in self.plan_files:
                if check_plain_name(str(entry["path"]), "plan file") and not isinstance(entry["rows"], int):
                    raise TypeError("a plan file's rows is not an integer")
        except (KeyError, TypeError, ValueError, FlashcpError) as e:
            what = f"lacks {e}" if isinstance(e, KeyError) else f"is damaged ({e})"
            raise FlashcpError(f"{meta_path} {what}; re-run 'flashcp plan --force'") from None
        if self.cp < 1:
            raise FlashcpError(f"{meta_path} is damaged (cp {self.cp}); re-run 'flashcp plan --force'")
        self.token_slack = float(self.meta.get("params", {}).get("token_slack") or 0.0)
        self.model: ModelSpec | None = None
        """The model the plan was priced for (plan.json's ``model``); None for a plan made before plans recorded
        it, priced for the shape of its parameters (``cost_shape``, H = H_kv = 32, D = 128 by default)."""
        if "model" in self.meta:
            try:
                self.model = ModelSpec.from_dict(self.meta["model"])
            except ModelError as e:
                raise FlashcpError(f"{meta_path} is damaged (its model: {e}); re-run 'flashcp plan --force'") from None
        self.check_fresh()
        if len(self.plan_files) != len(dataset.files):
            raise FlashcpError(f"plan '{name}' lists {len(self.plan_files)} plan files for the "
                               f"{len(dataset.files)} data files of {dataset.root}; re-run 'flashcp plan --force'")
        for index, data_file in enumerate(dataset.files):
            if self.plan_files[index]["rows"] != data_file.rows:
                raise FlashcpError(f"plan '{name}' records {self.plan_files[index]['rows']} rows for data file "
                                   f"{data_file.path}, which has {data_file.rows}; re-run 'flashcp plan --force'")
            problem = self.file_problem(index)
            if problem:
                raise FlashcpError(f"{problem}; re-run 'flashcp plan --force'")

    def file_problem(self, index: int) -> str | None:
        """Why the ``index``-th plan file does not match plan.json by size and footer (None when it does)."""
        entry, path = self.plan_files[index], self.plan_path(index)
        try:
            size = path.stat().st_size
        except OSError as e:
            return f"plan file {path} cannot be read ({e.strerror or e})"
        recorded = entry.get("bytes")  # None: written before plan.json recorded sizes
        if recorded is not None and size != recorded:
            return f"plan file {path} has {size:,} bytes but plan.json records {recorded:,}: it was replaced " \
                   "or truncated"
        try:
            footer = parquet_footer(path)
        except (OSError, ValueError) as e:
            return f"plan file {path} cannot be read as Parquet ({e})"
        if recorded is not None and footer.sha256 != entry.get("footer_sha256"):
            return f"plan file {path} is not the file plan.json records (its Parquet footer differs)"
        if footer.num_rows != entry["rows"]:
            return (f"plan file {path} holds {footer.num_rows:,} rows by its own footer but plan.json records "
                    f"{entry['rows']:,}")
        cp = footer.metadata.get(CP_KEY)  # None in plan files written before it was recorded
        if cp is not None and cp != str(self.cp).encode():
            return (f"plan file {path} was made for cp {cp.decode(errors='replace')} but plan.json says cp "
                    f"{self.cp}: plan.json does not describe its plan files")
        return None

    def check_fresh(self) -> None:
        """Raise StalePlanError unless the plan was made from the data files the manifest lists now."""
        current = [(f.path, f.sha256) for f in self.dataset.files]
        if self.data_files != current or self.context_len != self.dataset.context_len:
            raise StalePlanError(f"plan '{self.name}' is stale: it was made from other data files than "
                                 f"{self.dataset.root} holds now; re-run 'flashcp plan' (with --force)")

    def plan_path(self, index: int) -> Path:
        """Path of the plan file matching the ``index``-th data file."""
        return self.dir / self.plan_files[index]["path"]

    def read_flat(self, index: int) -> dict[str, np.ndarray]:
        """The whole ``index``-th plan file as flat int64/float64 arrays.

        Keys: ``shard_offsets`` (rows + 1,) indexing the flat ``shard_doc``, ``shard_start``, ``shard_len``,
        ``shard_rank``; and per row ``imbalance``, ``ag_comm_tokens``, ``a2a_comm_tokens`` and, when the file
        has the column, ``seq_cost``.
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
            offsets = numpy_values(column.offsets).astype(np.int64)
            out[name] = numpy_values(column.values).astype(np.int64)[offsets[0]:offsets[-1]]
            if name == "shard_doc":
                out["shard_offsets"] = offsets - offsets[0]
            elif not np.array_equal(offsets - offsets[0], out["shard_offsets"]):
                raise FlashcpError(f"plan file {path} is corrupt: its shard columns have different lengths")
        for name in ("imbalance", "ag_comm_tokens", "a2a_comm_tokens"):
            values = numpy_values(table.column(name).combine_chunks())
            out[name] = values.astype(np.float64 if name == "imbalance" else np.int64)
        if self._has_seq_cost(index):
            out[SEQ_COST] = numpy_values(table.column(SEQ_COST).combine_chunks()).astype(np.float64)
        return out

    @property
    def cost_shape(self) -> AttentionShape:
        """The model shape the plan's prices (``seq_cost``) are made with.

        Its model's ``attention_shape()``; for a plan made before plan.json recorded a model, the shape of its
        parameters (``AttentionShape.from_params``: H = H_kv = 32, D = 128, one layer unless they say more).
        """
        if self.model is not None:
            return self.model.attention_shape()
        params = self.meta.get("params")
        return AttentionShape.from_params(params if isinstance(params, dict) else {})

    def describe_model(self) -> str:
        """One line naming the model the plan was priced for (``ModelSpec.describe``), or the old shape."""
        if self.model is not None:
            return self.model.describe()
        shape = self.cost_shape
        return (f"no model recorded (made before plans recorded one): priced for H={shape.num_heads}, "
                f"H_kv={shape.num_kv_heads}, D={shape.head_dim}, {shape.layers} layer(s)")

    def _has_seq_cost(self, index: int) -> bool:
        return SEQ_COST in self._open(index).schema_arrow.names

    def seq_costs(self, index: int) -> np.ndarray:
        """(rows,) float64: the price of every sequence of the ``index``-th data file, in row order.

        Read from the plan's ``seq_cost`` column (one column, a few bytes per row); for a plan file made
        before it, computed from the data file's document lengths with ``cost_shape``.
        """
        if self._has_seq_cost(index):
            try:
                column = self._open(index).read(columns=[SEQ_COST]).column(SEQ_COST).combine_chunks()
            except (OSError, pa.ArrowException) as e:
                raise FlashcpError(f"plan file {self.plan_path(index)} cannot be read ({e}); "
                                   "re-run 'flashcp plan --force'") from None
            return numpy_values(column).astype(np.float64)
        offsets, lens = self.dataset.read_doc_lens(index)
        return sequence_flops(offsets, lens, self.cost_shape)

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
            yield from self._checked(index, pf.read_row_group(g))

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
        return list(self._checked(index, table.slice(offset, stop - start)))

    def check_row(self, stored: StoredPlan, doc_lens: np.ndarray, index: int, row: int) -> None:
        """PlanError (one sentence) unless ``stored`` fits row ``row`` of the ``index``-th data file.

        It must cover the documents ``doc_lens`` exactly once, give every rank its quota (within the plan's
        token slack), and its stored metrics must equal the recomputed ones. The row check of every reader
        that takes one row at a time (``show``, ``audit``); ``SequencePlan.validate`` is what ``CPLoader``
        runs too.
        """
        try:
            stored.plan.validate(doc_lens, token_slack=int(slack_tokens(self.token_slack, int(doc_lens.sum()),
                                                                        self.cp)))
            check_metrics(stored.plan, stored.imbalance, stored.ag_comm_tokens, stored.a2a_comm_tokens)
            self.check_seq_cost(stored.seq_cost, doc_lens)
        except PlanError as e:
            raise PlanError(f"plan '{self.name}' does not fit row {row} of data file "
                            f"{self.dataset.files[index].path}: {e}; re-run 'flashcp plan --force'") from None

    def check_seq_cost(self, seq_cost: float | None, doc_lens: np.ndarray) -> None:
        """PlanError unless a stored ``seq_cost`` (None: not stored) equals the recomputed price."""
        if seq_cost is None:
            return
        expected = float(sequence_flops([0, len(doc_lens)], doc_lens, self.cost_shape)[0])
        if not np.isclose(seq_cost, expected, rtol=1e-12, atol=0):
            raise PlanError(f"stored sequence cost {seq_cost} differs from the recomputed {expected}")

    def _checked(self, index: int, table: pa.Table) -> Iterator[StoredPlan]:
        """The table's plans, each checked against the plan's ``cp``; PlanError when one is not for it.

        A plan must name ranks in ``[0, cp)`` only and, with exact quotas, give every rank its quota: a plan.json
        whose ``cp`` was edited never hands ranks empty batches.
        """
        quotas = token_quotas(self.context_len, self.cp) if self.token_slack == 0 else None
        for stored in _stored_plans(table, self.cp):
            rank = stored.plan.shard_rank
            if rank.size and (int(rank.min()) < 0 or int(rank.max()) >= self.cp):
                bad = int(rank.min()) if int(rank.min()) < 0 else int(rank.max())
                raise PlanError(f"plan file {self.plan_path(index)} names rank {bad} in a plan for cp {self.cp}; "
                                "re-run 'flashcp plan --force'")
            if quotas is not None and not np.array_equal(rank_tokens(stored.plan.shard_len, rank, self.cp),
                                                         quotas):
                raise PlanError(f"plan file {self.plan_path(index)} does not give every one of its cp {self.cp} "
                                "ranks its equal-token quota (plan.json's cp may have been edited); re-run "
                                "'flashcp plan --force'")
            yield stored


def _stored_plans(table: pa.Table, cp: int) -> Iterator[StoredPlan]:
    cols = {name: table.column(name).combine_chunks() for name in PLAN_SCHEMA.names
            if name in table.column_names}
    shard_cols = ("shard_doc", "shard_start", "shard_len", "shard_rank")
    offsets = numpy_values(cols["shard_doc"].offsets).astype(np.int64)
    offsets -= offsets[0]  # a sliced table's offsets start mid-buffer; flatten() below honours the slice
    flat = {name: numpy_values(cols[name].flatten()).astype(np.int64) for name in shard_cols}
    imbalance = numpy_values(cols["imbalance"])
    ag = numpy_values(cols["ag_comm_tokens"])
    a2a = numpy_values(cols["a2a_comm_tokens"])
    cost = numpy_values(cols[SEQ_COST]) if SEQ_COST in cols else None
    for i in range(table.num_rows):
        lo, hi = offsets[i], offsets[i + 1]
        plan = SequencePlan(shard_doc=flat["shard_doc"][lo:hi], shard_start=flat["shard_start"][lo:hi],
                            shard_len=flat["shard_len"][lo:hi], shard_rank=flat["shard_rank"][lo:hi], cp=cp)
        yield StoredPlan(plan=plan, imbalance=float(imbalance[i]), ag_comm_tokens=int(ag[i]),
                         a2a_comm_tokens=int(a2a[i]), seq_cost=None if cost is None else float(cost[i]))
