"""Writing plans: plan files, ``plan.json``, and the slot a plan folder is built in and swapped into place.

``flashcp plan`` writes a plan file with :class:`PlanFileWriter`, one row group per row group of its data
file (planned, validated and written before the next is read); ``write_plan_file`` writes a whole table in
row groups of ``PLAN_ROW_GROUP_ROWS`` (audit, tests). ``plan.json`` is written last; a plan exists once it
exists. The format is ``flashcp.planner.plan_reader``'s.

Writers go through :class:`PlanSlot`: the plan name is checked to be a plain folder name before anything is
touched, a lock per plan name keeps two writers apart, the new plan is built in a hidden staging folder
beside the old one (``plans/.<name>.<pid>-<hex>.tmp``) and swapped in at the end, and only flashcp's own
plan folders are ever replaced. Staging folders left by a killed run are removed by the next writer of that
name (and reported), when they hold nothing but flashcp's own plan files; ``plans`` and the plan folder are
never followed when they are symlinks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flashcp import __version__
from flashcp.costmodel.profile import profile_from_json
from flashcp.data.dataset import Dataset, arrow_array
from flashcp.errors import FlashcpError, StalePlanError
from flashcp.fileio import (
    PARQUET_COMPRESSION,
    FolderLock,
    atomic_path,
    check_plain_name,
    drop_lock,
    hold_lock,
    is_plain_tree,
    parquet_fingerprint,
    refuse_symlink,
    replace_dir,
    sha256_file,
    write_json_atomic,
    write_parquet_atomic,
)
from flashcp.planner.plan_reader import (
    CP_KEY,
    PLAN_FORMAT_VERSION,
    PLAN_JSON,
    PLAN_SCHEMA,
    PLANS_DIR,
    SEQ_COST,
    PlanStore,
)

__all__ = [
    "PLAN_ROW_GROUP_ROWS",
    "PlanFileWriter",
    "PlanSlot",
    "plan_name",
    "plan_table",
    "profile_record",
    "write_plan_file",
    "write_plan_json",
]

PLAN_ROW_GROUP_ROWS = 4096
"""Rows per row group of a plan file written whole (``write_plan_file``)."""


def plan_name(cp: int, strategy: str) -> str:
    """The default plan folder name, e.g. ``cp8-flashcp``."""
    return f"cp{cp}-{strategy}"


def plan_table(shard_offsets: np.ndarray, shard_doc: np.ndarray, shard_start: np.ndarray,
               shard_len: np.ndarray, shard_rank: np.ndarray, imbalance: np.ndarray,
               ag_comm_tokens: np.ndarray, a2a_comm_tokens: np.ndarray,
               seq_cost: np.ndarray | None) -> pa.Table:
    """Build a plan table from flat shard arrays; ``shard_offsets`` (rows + 1,) indexes them by row.

    ``seq_cost`` (rows,) float64: each sequence's price; None leaves the column out (a plan file of the
    layout before it, which readers still accept).
    """
    offsets = arrow_array(shard_offsets, pa.int32())

    def column(values, value_type):
        return pa.ListArray.from_arrays(offsets, arrow_array(values, value_type))

    return pa.table({
        "shard_doc": column(shard_doc, pa.int32()),
        "shard_start": column(shard_start, pa.int32()),
        "shard_len": column(shard_len, pa.int32()),
        "shard_rank": column(shard_rank, pa.int16()),
        "imbalance": arrow_array(imbalance, pa.float64()),
        "ag_comm_tokens": arrow_array(ag_comm_tokens, pa.int64()),
        "a2a_comm_tokens": arrow_array(a2a_comm_tokens, pa.int64()),
        **({} if seq_cost is None else {SEQ_COST: arrow_array(seq_cost, pa.float64())}),
    }, schema=PLAN_SCHEMA if seq_cost is not None else _without_seq_cost(PLAN_SCHEMA))


def _without_seq_cost(schema: pa.Schema) -> pa.Schema:
    return schema.remove(schema.get_field_index(SEQ_COST))


def write_plan_file(plan_dir: Path, index: int, table: pa.Table, cp: int | None = None) -> dict:
    """Write the plan file matching the ``index``-th data file, atomically; return its plan.json entry.

    ``cp`` is recorded in the file's footer (``CP_KEY``), so that a plan.json edited to another ``cp`` is
    refused at open.
    """
    path = plan_dir / f"part-{index:05d}.parquet"
    if cp is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), CP_KEY: str(int(cp)).encode()})
    write_parquet_atomic(path, table, PLAN_ROW_GROUP_ROWS)
    size, footer = parquet_fingerprint(path)
    return {"path": path.name, "rows": table.num_rows, "sha256": sha256_file(path), "bytes": size,
            "footer_sha256": footer}


class PlanFileWriter:
    """Writes the plan file matching the ``index``-th data file one row group at a time.

    Each ``write`` appends one row group, so a planner holds only the rows it is writing. Rows go to a temporary
    file beside the final name (``atomic_path``) with the options of :func:`write_plan_file` (zstd, no
    statistics); ``close`` renames it into place and returns its plan.json entry, ``abort`` removes it.
    ``cp`` is recorded in the footer (``CP_KEY``) as :func:`write_plan_file` does.
    """

    def __init__(self, plan_dir: Path, index: int, cp: int | None = None):
        self.path = Path(plan_dir) / f"part-{index:05d}.parquet"
        self._atomic = atomic_path(self.path)
        schema = PLAN_SCHEMA if cp is None else PLAN_SCHEMA.with_metadata({CP_KEY: str(int(cp)).encode()})
        tmp = self._atomic.__enter__()
        try:
            self._writer = pq.ParquetWriter(tmp, schema, compression=PARQUET_COMPRESSION,
                                            write_statistics=False, store_schema=True)
        except BaseException as e:
            self._atomic.__exit__(type(e), e, e.__traceback__)
            raise
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        """Append ``table`` (:data:`PLAN_SCHEMA`) as one row group."""
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.rows += table.num_rows

    def close(self) -> dict:
        """Finish the file, move it to its final name, and return its plan.json entry."""
        self._writer.close()
        self._atomic.__exit__(None, None, None)
        size, footer = parquet_fingerprint(self.path)
        return {"path": self.path.name, "rows": self.rows, "sha256": sha256_file(self.path), "bytes": size,
                "footer_sha256": footer}

    def abort(self) -> None:
        """Drop the file being written."""
        try:
            self._writer.close()
        finally:
            aborted = RuntimeError("plan file aborted")
            self._atomic.__exit__(RuntimeError, aborted, None)


def profile_record(path: str | Path) -> dict:
    """plan.json's ``profile``: the hardware profile file a plan was priced with, its content included.

    A reader takes the profile from here, never from the file again: the file may be edited or moved after the
    plan was made, and the plan stays what it was.
    """
    try:
        raw = Path(path).read_bytes()
        content = json.loads(raw)
    except (OSError, ValueError) as e:
        raise FlashcpError(f"hardware profile {path} cannot be read ({e})") from None
    profile_from_json(content, str(path))  # a valid profile, or one sentence
    return {"path": str(path), "sha256": hashlib.sha256(raw).hexdigest(), "content": content}


def write_plan_json(plan_dir: Path, *, dataset: Dataset, strategy: str, params: dict, cp: int,
                    plan_files: list[dict], summary: dict, name: str | None = None,
                    model: dict | None = None) -> dict:
    """Write ``plan.json`` last, atomically, and return it; ``name`` defaults to the folder's name.

    A ``profile`` path among ``params`` is recorded with its content (``profile_record``); ``model``
    (``ModelSpec.as_dict()``, the model every price was made for) as ``model``.
    """
    profile = params.get("profile") if isinstance(params, dict) else None
    meta = {
        "format": "flashcp-plan",
        "format_version": PLAN_FORMAT_VERSION,
        "flashcp_version": __version__,
        "name": name or plan_dir.name,
        "strategy": strategy,
        "params": params,
        "cp": int(cp),
        "context_len": dataset.context_len,
        "data_files": [{"path": f.path, "sha256": f.sha256} for f in dataset.files],
        "plan_files": plan_files,
        "summary": summary,
    }
    if model is not None:
        meta["model"] = model
    if profile is not None:
        meta["profile"] = profile_record(profile)
    write_json_atomic(plan_dir / PLAN_JSON, meta, strict=True)
    return meta


_PLAN_FILE = re.compile(r"(plan\.json|part-\d{5}\.parquet|\.(plan\.json|part-\d{5}\.parquet)\..+\.tmp)")


class PlanSlot:
    """The right to write ``plans/<name>`` of a dataset, held from the checks to the swap.

    Use as a context manager: ``staging()`` makes the folder to build the plan in (``plan.json`` included,
    written last), ``commit()`` swaps it into place; leaving the block without ``commit`` removes it, so a
    failure leaves the old plan (or nothing) exactly as it was. ``notes`` says what was cleaned up.

    ``wanted(meta)`` (optional) says how an existing plan's ``plan.json`` differs from the plan about to be
    made (None: made with the same parameters). Without ``force``, an existing plan made alike from the
    dataset as it is now, every plan file as plan.json records it, is not an error: ``up_to_date`` then
    holds its plan.json and nothing need be written (as ``pack`` does with a finished dataset).
    """

    def __init__(self, dataset: Dataset, name: str, *, force: bool, what: str = "plan name",
                 wanted: Callable[[dict], str | None] | None = None):
        check_plain_name(name, what)
        self.dataset = dataset
        self.root, self.name = dataset.root, name
        self.up_to_date: dict | None = None
        self._wanted = wanted
        self.plans_root = self.root / PLANS_DIR
        self.final = self.plans_root / name
        self.notes: list[str] = []
        self._staging: Path | None = None
        refuse_symlink(self.plans_root, self.root)
        if self.plans_root.exists() and not self.plans_root.is_dir():
            raise FlashcpError(f"{self.plans_root} is a file, not a plans folder; move it away")
        self._root_fd = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(self._root_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # 'pack' holds it exclusively
        except OSError:
            os.close(self._root_fd)
            raise FlashcpError(f"a flashcp pack is writing to {self.root}; wait for it to finish") from None
        hold_lock(self._root_fd)
        self._lock: FolderLock | None = None
        try:
            self.plans_root.mkdir(exist_ok=True)
            self._lock = FolderLock(self.plans_root / f".{name}.lock",
                                    f"another flashcp command is writing plan '{name}' in {self.root}; wait "
                                    "for it to finish")
            self._clean_leftovers()
            self._check_existing(force)
        except OSError as e:
            self.release()
            raise FlashcpError(f"cannot write plan '{name}' in {self.root}: {e.strerror or e}") from None
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> PlanSlot:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
        finally:
            self.release()

    def _leftovers(self) -> Iterator[tuple[Path, bool]]:
        pattern = re.compile(rf"\.{re.escape(self.name)}\.(old-)?\d+-[0-9a-f]{{8}}\.tmp")
        for entry in list(self.plans_root.iterdir()):
            match = pattern.fullmatch(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                yield entry, match.group(1) is not None

    def _clean_leftovers(self) -> None:
        """Remove staging folders of killed runs of this name; put back an old plan a crash left aside."""
        removed = 0
        for entry, is_old in sorted(self._leftovers()):
            if is_plain_tree(entry, lambda p: p.is_file() and _PLAN_FILE.fullmatch(p.name) is not None):
                self.notes.append(f"left plans/{entry.name} alone: it has the name of a staging folder but holds "
                                  "files flashcp did not write")
                continue  # only folders holding nothing but flashcp's own plan files are flashcp's
            if is_old and not self.final.exists() and (entry / PLAN_JSON).is_file():
                os.replace(entry, self.final)
                self.notes.append(f"restored plan '{self.name}' that an interrupted run had moved aside")
                continue
            shutil.rmtree(entry)
            removed += 1
        if removed:
            self.notes.append(f"removed {removed} staging folder(s) of plan '{self.name}' left by an interrupted "
                              "run")

    def _check_existing(self, force: bool) -> None:
        refuse_symlink(self.final, self.root)
        if not self.final.exists():
            return
        where = f"plans/{self.name} in {self.root}"
        if not self.final.is_dir():
            raise FlashcpError(f"{where} is a file, not a plan folder; move it away or choose another name")
        for entry in self.final.iterdir():
            if entry.is_symlink() or not entry.is_file() or not _PLAN_FILE.fullmatch(entry.name):
                raise FlashcpError(f"{where} holds '{entry.name}', which flashcp did not write; flashcp "
                                   "replaces only its own plan folders: move it away or choose another name")
        meta_path = self.final / PLAN_JSON
        if meta_path.is_file():
            try:
                meta = json.loads(meta_path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError):
                meta = None
            if not isinstance(meta, dict) or meta.get("format") != "flashcp-plan":
                raise FlashcpError(f"{where} holds a plan.json that is not a flashcp plan; move it away or "
                                   "choose another name")
            if not force:
                difference = self._wanted(meta) if self._wanted is not None else None
                if self._wanted is not None and difference is None:
                    problem = self._intact_problem()
                    if problem is None:
                        self.up_to_date = meta
                        return
                    raise FlashcpError(f"plan '{self.name}' in {self.root} was made with these parameters but "
                                       f"not as it is now: {problem}; pass --force to make it again")
                made = f", made with other parameters ({difference})" if difference else ""
                raise FlashcpError(f"plan '{self.name}' already exists in {self.root}{made}; pass --force to "
                                   "replace it")
        elif any(self.final.iterdir()) and not force:
            raise FlashcpError(f"{where} holds an unfinished plan (no plan.json); pass --force to replace it")

    def _intact_problem(self) -> str | None:
        """Why the existing plan is not the one its plan.json describes for the data as it is now (or None).

        Every reader's checks at open (fresh, every plan file's size, footer and rows), then every plan
        file's sha256, as ``pack`` re-hashes a finished dataset's files before calling it done.
        """
        try:
            store = PlanStore(self.dataset, self.name)
        except StalePlanError:
            return "it was made from other data files than the dataset holds"
        except FlashcpError as e:
            return str(e).split("; re-run")[0]
        for index, entry in enumerate(store.plan_files):
            if sha256_file(store.plan_path(index)) != entry.get("sha256"):
                return f"plan file {store.plan_path(index)} does not match plan.json"
        return None

    def staging(self) -> Path:
        """A new, empty hidden folder beside the plan to build it in."""
        self._staging = self.plans_root / f".{self.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        self._staging.mkdir()
        return self._staging

    def commit(self) -> None:
        """Swap the finished staging folder (``plan.json`` written) into place; remove the old plan."""
        assert self._staging is not None and (self._staging / PLAN_JSON).is_file()
        old = self.plans_root / f".{self.name}.old-{os.getpid()}-{secrets.token_hex(4)}.tmp"
        replace_dir(self._staging, self.final, old)
        self._staging = None
        shutil.rmtree(old, ignore_errors=True)

    def release(self) -> None:
        """Drop the locks (also done on leaving the ``with`` block)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._root_fd >= 0:
            drop_lock(self._root_fd)
            os.close(self._root_fd)
            self._root_fd = -1
