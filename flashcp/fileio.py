"""Crash-safe file writing and hashing: write to a temporary name in the same folder, fsync, rename."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["atomic_path", "sha256_file", "write_json_atomic", "write_parquet_atomic"]

PARQUET_COMPRESSION = "zstd"


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success fsync it and rename it onto ``path``.

    On failure the temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_parquet_atomic(path: str | os.PathLike, table: pa.Table, row_group_rows: int) -> None:
    """Write ``table`` as zstd Parquet with row groups of ``row_group_rows`` rows, atomically.

    Statistics and the creation timestamp-free defaults keep the bytes a function of the table alone.
    """
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=PARQUET_COMPRESSION, row_group_size=max(1, row_group_rows),
                       write_statistics=False, store_schema=True)
