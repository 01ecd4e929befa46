"""A flashcp dataset on disk: ``manifest.json`` plus ``data/part-NNNNN.parquet`` (docs/DESIGN.md section 4).

The dataset exists once its manifest exists; the manifest is always written last. This module owns the data
file schema, the manifest's shape, and the readers that planners, the loader and the bench share.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flashcp import __version__
from flashcp.errors import FlashcpError
from flashcp.fileio import (
    PARQUET_COMPRESSION,
    atomic_path,
    parquet_fingerprint,
    parquet_footer,
    sha256_file,
    write_json_atomic,
    write_parquet_atomic,
)

__all__ = [
    "DATA_SCHEMA",
    "FORMAT_VERSION",
    "LENGTHS_SCHEMA",
    "Dataset",
    "arrow_array",
    "DataFile",
    "DataFileWriter",
    "data_table",
    "numpy_values",
    "write_data_file",
    "write_manifest",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
REPLACE_OLD_DIR = ".flashcp-replaced"
"""Where ``pack --force`` moves the old dataset during the swap (``flashcp.data.pack_output``)."""

DATA_SCHEMA = pa.schema([
    ("tokens", pa.list_(pa.int32())),
    ("doc_lens", pa.list_(pa.int32())),
    ("doc_source", pa.list_(pa.int64())),
    ("doc_offset", pa.list_(pa.int32())),
])
"""One row per packed sequence; ``tokens`` has exactly ``context_len`` ids and ``doc_lens`` sums to it."""

LENGTHS_SCHEMA = pa.schema([f for f in DATA_SCHEMA if f.name != "tokens"])
"""A lengths-only dataset (``synth --no-tokens``): the same columns without ``tokens``."""


def data_file_name(index: int) -> str:
    """Relative path of the ``index``-th data file."""
    return f"{DATA_DIR}/part-{index:05d}.parquet"


_NUMPY_TYPES = {pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64, pa.float64(): np.float64}


def arrow_array(values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A numpy array as an Arrow array of ``value_type`` without a copy (and without importing pandas).

    Like ``pa.array(values, value_type)``, ArrowInvalid when an integer does not fit the narrower type.
    """
    # zero-copy, and unlike pa.array() it does not import pandas (half a second) to inspect its argument
    values = np.asarray(values)
    wanted = np.dtype(_NUMPY_TYPES[value_type])
    if values.size and wanted.kind == "i" and values.dtype != wanted:
        info = np.iinfo(wanted.type)  # type: ignore[type-var]  # an integer dtype: kind 'i' above
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            raise pa.ArrowInvalid(f"value {low if low < info.min else high} does not fit {value_type}")
    values = np.ascontiguousarray(values, dtype=wanted)
    return pa.Array.from_buffers(value_type, values.size, [None, pa.py_buffer(values)])


def numpy_values(array: pa.Array) -> np.ndarray:
    """A null-free fixed-width Arrow array as a zero-copy numpy view.

    ``Array.to_numpy`` imports pandas on first use (half a second per process); reading the data buffer does
    not.
    """
    if array.null_count:
        raise ValueError("the column holds nulls")
    kind = "float" if pa.types.is_floating(array.type) else "int" if pa.types.is_signed_integer(array.type) \
        else None
    if kind is None:
        raise TypeError(f"no zero-copy view of {array.type}")
    dtype = np.dtype(f"{kind}{array.type.bit_width}")
    buffer = array.buffers()[1]
    if buffer is None:
        return np.zeros(0, dtype)
    return np.frombuffer(buffer, dtype=dtype, count=array.offset + len(array))[array.offset:]


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    return pa.ListArray.from_arrays(arrow_array(offsets, pa.int32()), arrow_array(values, value_type))


def data_table(doc_offsets: np.ndarray, doc_lens: np.ndarray, doc_source: np.ndarray, doc_offset: np.ndarray,
               tokens: np.ndarray | None, context_len: int) -> pa.Table:
    """Build a data table from flat arrays.

    ``doc_offsets`` (num_rows + 1,) indexes the flat per-document arrays ``doc_lens``, ``doc_source`` and
    ``doc_offset``; ``tokens`` is flat (num_rows * context_len,) or None for a lengths-only table.
    """
    num_rows = doc_offsets.size - 1
    columns = {
        "doc_lens": _list_array(doc_offsets, doc_lens, pa.int32()),
        "doc_source": _list_array(doc_offsets, doc_source, pa.int64()),
        "doc_offset": _list_array(doc_offsets, doc_offset, pa.int32()),
    }
    if tokens is None:
        return pa.table(columns, schema=LENGTHS_SCHEMA)
    token_offsets = np.arange(num_rows + 1, dtype=np.int64) * context_len
    return pa.table({"tokens": _list_array(token_offsets, tokens, pa.int32()), **columns}, schema=DATA_SCHEMA)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataFile:
    """One data file as the manifest records it."""

    path: str
    """Path relative to the dataset folder."""
    rows: int
    """Packed sequences in the file."""
    tokens: int
    """Tokens in the file (rows * context_len)."""
    sha256: str
    """Hex sha256 of the file's bytes."""
    bytes: int | None = None
    """File size; with ``footer_sha256`` what every reader checks at open (None in older manifests)."""
    footer_sha256: str | None = None
    """sha256 of the file's Parquet footer (``flashcp.fileio.parquet_fingerprint``), or None."""

    def to_json(self) -> dict:
        """The manifest entry."""
        entry: dict = {"path": self.path, "rows": self.rows, "tokens": self.tokens, "sha256": self.sha256}
        if self.bytes is not None:
            entry["bytes"], entry["footer_sha256"] = self.bytes, self.footer_sha256
        return entry

    @staticmethod
    def made(root: Path, rel: str, rows: int, tokens: int) -> DataFile:
        """The entry of a data file just written at ``root / rel``: sha256, size and footer fingerprint."""
        size, footer = parquet_fingerprint(root / rel)
        return DataFile(path=rel, rows=rows, tokens=tokens, sha256=sha256_file(root / rel), bytes=size,
                        footer_sha256=footer)


def write_data_file(root: Path, index: int, table: pa.Table, row_group_rows: int) -> DataFile:
    """Write ``table`` as the ``index``-th data file of the dataset at ``root``, atomically."""
    rel = data_file_name(index)
    write_parquet_atomic(root / rel, table, row_group_rows)
    lens = numpy_values(table.column("doc_lens").combine_chunks().flatten())
    return DataFile.made(root, rel, table.num_rows, int(lens.sum(dtype=np.int64)))


class DataFileWriter:
    """Writes the ``index``-th data file one row group at a time, for data too large to hold at once.

    Rows go to a temporary file beside the final name (``atomic_path``: ``.part-NNNNN.parquet.*.tmp``) with
    zstd compression and no dictionary encoding; ``close`` renames it into place, ``abort`` removes it.
    """

    def __init__(self, root: Path, index: int, schema: pa.Schema = DATA_SCHEMA):
        self.root = Path(root)
        self.rel = data_file_name(index)
        self._atomic = atomic_path(self.root / self.rel)
        tmp = self._atomic.__enter__()
        try:
            # plain encoding: with vocabularies of ~10^5 ids a dictionary overflows and costs time and space
            self._writer = pq.ParquetWriter(tmp, schema, compression=PARQUET_COMPRESSION,
                                            use_dictionary=False, write_statistics=False, store_schema=True)
        except BaseException as e:
            self._atomic.__exit__(type(e), e, e.__traceback__)
            raise
        self.rows = 0
        self.tokens = 0

    def write(self, table: pa.Table) -> None:
        """Append ``table`` as one row group."""
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self.rows += table.num_rows
        self.tokens += int(pc.sum(table.column("doc_lens").combine_chunks().flatten()).as_py() or 0)

    def close(self) -> DataFile:
        """Finish the file, move it to its final name, and return its manifest entry."""
        self._writer.close()
        self._atomic.__exit__(None, None, None)
        return DataFile.made(self.root, self.rel, self.rows, self.tokens)

    def abort(self) -> None:
        """Drop the file being written."""
        try:
            self._writer.close()
        finally:
            aborted = RuntimeError("data file aborted")
            self._atomic.__exit__(RuntimeError, aborted, None)


def _field(obj: dict, key: str, kind: type):
    if key not in obj:
        raise KeyError(f"it lacks '{key}'")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"'{key}' is {type(value).__name__}, not {kind.__name__}")
    return value


def _data_file(entry) -> DataFile:
    if not isinstance(entry, dict):
        raise TypeError("a 'files' entry is not an object")
    path = _field(entry, "path", str)
    parts = Path(path).parts
    if Path(path).is_absolute() or ".." in parts or not parts or parts[0] != DATA_DIR:
        raise ValueError(f"data file path {path!r} is not inside {DATA_DIR}/")
    size, footer = entry.get("bytes"), entry.get("footer_sha256")
    if size is not None and (not isinstance(size, int) or not isinstance(footer, str)):
        raise TypeError("a 'files' entry has a bad 'bytes' or 'footer_sha256'")
    return DataFile(path=path, rows=_field(entry, "rows", int), tokens=_field(entry, "tokens", int),
                    sha256=_field(entry, "sha256", str), bytes=size, footer_sha256=footer)


def write_manifest(root: Path, *, context_len: int, has_tokens: bool, created_by: str, tokenizer: dict | None,
                   options: dict, inputs: list[dict], files: list[DataFile], counts: dict) -> dict:
    """Write ``manifest.json`` (last, atomically) and return it.

    ``tokenizer`` holds at least ``name`` and ``sha256``; ``inputs`` lists ``{"path", "bytes", "sha256"}``;
    ``counts`` holds the documents read, dropped, split and truncated, and whatever else the writer counted.
    """
    manifest = {
        "format": "flashcp-dataset",
        "format_version": FORMAT_VERSION,
        "flashcp_version": __version__,
        "created_by": created_by,
        "context_len": int(context_len),
        "has_tokens": bool(has_tokens),
        "tokenizer": tokenizer,
        "options": options,
        "inputs": inputs,
        "files": [f.to_json() for f in files],
        "num_sequences": int(sum(f.rows for f in files)),
        "counts": counts,
    }
    write_json_atomic(root / MANIFEST_NAME, manifest)
    return manifest


class Dataset:
    """A dataset folder opened for reading. Raises FlashcpError with one sentence when it is not one.

    Opening checks every data file cheaply against the manifest (it exists, has the recorded size and Parquet
    footer, and the row count its own footer records), so a replaced or truncated file, or a manifest edited
    to say otherwise, is refused here rather than read; ``verify`` re-hashes the bytes. ``check_files=False``
    skips that (for callers that check, or report, the files themselves).
    """

    def __init__(self, root: str | Path, *, check_files: bool = True):
        self.root = Path(root)
        manifest_path = self.root / MANIFEST_NAME
        if not self.root.exists():
            raise FlashcpError(f"{self.root} is not a dataset folder: it does not exist")
        if not self.root.is_dir():
            raise FlashcpError(f"{self.root} is a file, not a dataset folder")
        if not manifest_path.is_file():
            interrupted = (self.root / REPLACE_OLD_DIR).exists()
            raise FlashcpError(f"{self.root} has no {MANIFEST_NAME}: " + (
                "an interrupted 'flashcp pack --force' was replacing it; re-run that command" if interrupted
                else "it is not a finished flashcp dataset (run 'flashcp pack' or 'flashcp synth' to make one)"))
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FlashcpError(f"{manifest_path} is not readable JSON ({e})") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != "flashcp-dataset":
            raise FlashcpError(f"{manifest_path} is not a flashcp dataset manifest")
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise FlashcpError(f"{manifest_path} has format version {self.manifest.get('format_version')}; "
                               f"this flashcp reads version {FORMAT_VERSION}")
        try:
            self.context_len: int = _field(self.manifest, "context_len", int)
            self.has_tokens: bool = _field(self.manifest, "has_tokens", bool)
            self.files: list[DataFile] = [_data_file(entry) for entry in _field(self.manifest, "files", list)]
            for data_file in self.files:
                if data_file.tokens != data_file.rows * self.context_len:
                    raise ValueError(f"{data_file.path} records {data_file.tokens} tokens in {data_file.rows} "
                                     f"rows of {self.context_len}")
        except (KeyError, TypeError, ValueError) as e:
            detail = e.args[0] if e.args else e  # KeyError's str() adds quotes
            raise FlashcpError(f"{manifest_path} is damaged ({detail}); re-create the dataset") from None
        if check_files:
            for data_file in self.files:
                problem = self.file_problem(data_file)
                if problem:
                    raise FlashcpError(f"{problem}; re-create the dataset or restore the file")

    def file_problem(self, data_file: DataFile) -> str | None:
        """Why ``data_file`` does not match the manifest by size and footer (None when it does)."""
        path = self.path(data_file)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"data file {path} listed in the manifest is missing"
        except OSError as e:
            return f"data file {path} cannot be read ({e.strerror or e})"
        if data_file.bytes is not None and size != data_file.bytes:
            return (f"data file {path} has {size:,} bytes but the manifest records {data_file.bytes:,}: it was "
                    "replaced or truncated")
        try:
            footer = parquet_footer(path)
        except (OSError, ValueError) as e:
            return f"data file {path} cannot be read as Parquet ({e})"
        if data_file.bytes is not None and footer.sha256 != data_file.footer_sha256:
            return f"data file {path} is not the file the manifest records (its Parquet footer differs): it was " \
                   "replaced or changed"
        if footer.num_rows != data_file.rows:  # the manifest edited, or (older manifests) the file replaced
            return (f"data file {path} holds {footer.num_rows:,} rows by its own footer but the manifest records "
                    f"{data_file.rows:,}: the manifest does not describe this file")
        return None

    @property
    def num_sequences(self) -> int:
        """Packed sequences in all data files."""
        return sum(f.rows for f in self.files)

    def path(self, data_file: DataFile) -> Path:
        """Absolute path of a data file."""
        return self.root / data_file.path

    def parquet(self, index: int) -> pq.ParquetFile:
        """The ``index``-th data file opened for row-group reads; a corrupt file gets one sentence."""
        path = self.path(self.files[index])
        try:
            return pq.ParquetFile(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise FlashcpError(f"data file {path} cannot be read as Parquet ({e}); re-create the dataset") from None

    def iter_doc_lens(self, index: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(row_offsets, doc_lens)`` per row group of the ``index``-th file.

        ``row_offsets`` (rows + 1,) int64 indexes the flat ``doc_lens`` (int64) by row: row i's documents are
        ``doc_lens[row_offsets[i]:row_offsets[i+1]]``. Only the ``doc_lens`` column is read.
        """
        pf = self.parquet(index)
        for g in range(pf.num_row_groups):
            try:
                column = pf.read_row_group(g, columns=["doc_lens"]).column("doc_lens").combine_chunks()
            except (OSError, pa.ArrowInvalid) as e:
                raise FlashcpError(f"data file {self.path(self.files[index])} is corrupt ({e}); "
                                   "re-create the dataset") from None
            offsets = numpy_values(column.offsets).astype(np.int64)
            values = numpy_values(column.values).astype(np.int64)
            yield offsets - offsets[0], values[offsets[0]:offsets[-1]]

    def read_doc_lens(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """All of the ``index``-th file's document lengths as ``(row_offsets, doc_lens)``."""
        offsets_parts, lens_parts, base = [np.zeros(1, np.int64)], [], 0
        for offsets, lens in self.iter_doc_lens(index):
            offsets_parts.append(offsets[1:] + base)
            lens_parts.append(lens)
            base += lens.size
        lens = np.concatenate(lens_parts) if lens_parts else np.zeros(0, np.int64)
        return np.concatenate(offsets_parts), lens
