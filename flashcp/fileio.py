"""Safe file operations: crash-safe writes, hashing, Parquet fingerprints, name and symlink checks, locks.

Writes go to a temporary name in the same folder, are fsynced and renamed into place; folders are replaced by
building the new one beside the old and swapping them at the end.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flashcp.errors import FlashcpError

__all__ = [
    "FolderLock",
    "atomic_path",
    "check_plain_name",
    "exchange_paths",
    "exit_with_parent",
    "ParquetFooter",
    "is_plain_tree",
    "parquet_fingerprint",
    "parquet_footer",
    "refuse_symlink",
    "replace_dir",
    "sha256_file",
    "write_json_atomic",
    "write_parquet_atomic",
]

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


def write_json_atomic(path: str | os.PathLike, obj, *, strict: bool = False) -> None:
    """Write ``obj`` as indented JSON, atomically; ``strict`` refuses NaN and infinities (not JSON)."""
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=not strict) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_parquet_atomic(path: str | os.PathLike, table: pa.Table, row_group_rows: int) -> None:
    """Write ``table`` as zstd Parquet with row groups of ``row_group_rows`` rows, atomically.

    Statistics and the creation timestamp-free defaults keep the bytes a function of the table alone.
    """
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression=PARQUET_COMPRESSION, row_group_size=max(1, row_group_rows),
                       write_statistics=False, store_schema=True)


# ---- safety rules shared by every command that writes inside a dataset ----

def check_plain_name(name: str, what: str) -> str:
    """``name`` unless it is not a plain folder name (empty, ``.``/``..``, a path, hidden, control chars).

    Checked before anything is touched, so a name can never reach outside the folder it is meant for.
    """
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise FlashcpError(f"{what} {name!r} is not a plain folder name; use letters, digits, '-', '_' or '+'")
    if "/" in name or "\\" in name or os.sep in name or name.startswith(".") or len(name.encode()) > 200 \
            or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise FlashcpError(f"{what} {name!r} is not a plain folder name (no '/', no leading '.', no control "
                           "characters, at most 200 bytes); use letters, digits, '-', '_' or '+'")
    return name


def refuse_symlink(path: Path, root: Path) -> None:
    """FlashcpError when ``path`` (inside the dataset ``root``) is a symlink.

    flashcp never writes, renames or deletes through one, so a link leading out of the dataset can never make
    it touch files elsewhere.
    """
    if path.is_symlink():
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        raise FlashcpError(f"{rel} in {root} is a symlink (to {os.readlink(path)}); flashcp does not write, "
                           "rename or delete through symlinks in a dataset; replace it with a folder")


def is_plain_tree(path: Path, allowed: Callable[[Path], bool]) -> Path | None:
    """The first entry under folder ``path`` that is a symlink or not ``allowed``; None when all are fine."""
    for dirpath, dirnames, filenames in os.walk(path):
        for entry in [*dirnames, *filenames]:
            full = Path(dirpath) / entry
            if full.is_symlink() or not allowed(full):
                return full
    return None


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where that is not available."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _load_renameat2():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_renameat2 = _load_renameat2() if sys.platform == "linux" else None


def replace_dir(staging: Path, final: Path, old: Path) -> None:
    """Put the finished folder ``staging`` at ``final``; what was at ``final`` ends at ``old``.

    The caller removes ``old``. Atomic where the OS can exchange two paths; elsewhere two renames, and a crash
    between them leaves the old folder at ``old``, which the next run puts back.
    """
    if final.exists():
        if exchange_paths(staging, final):
            os.replace(staging, old)
            return
        os.replace(final, old)
    os.replace(staging, final)


_held_locks: set[int] = set()
"""File descriptors of the locks this process holds (``FolderLock``, ``hold_lock``): a forked worker closes
its copies (``exit_with_parent``), so that a lock lives no longer than the process that took it."""


def hold_lock(fd: int) -> None:
    """Record ``fd`` as holding a lock of this process (see ``_held_locks``)."""
    _held_locks.add(fd)


def drop_lock(fd: int) -> None:
    """Forget ``fd`` (about to be closed)."""
    _held_locks.discard(fd)


PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int) -> None:
    """Make this worker process die with ``parent_pid`` and hold none of its locks; call first in a worker.

    A parent killed by SIGKILL (the OOM killer) cannot stop its pool, and an idle worker never notices: the
    workers of a killed ``plan --workers 2`` lived on, holding (through the descriptors fork copies) the plan
    lock and the dataset's shared lock, so every later ``plan`` of that name and ``pack --force`` were
    refused. On Linux the kernel sends SIGKILL to the worker when its parent dies (``PR_SET_PDEATHSIG``);
    elsewhere, and as a second guard, a thread polls ``os.getppid()``. Inherited lock descriptors are closed.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the kernel was told
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    for fd in list(_held_locks):
        try:
            os.close(fd)  # this copy only: the parent's descriptor keeps its lock
        except OSError:
            pass
    _held_locks.clear()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


class FolderLock:
    """An exclusive, non-blocking ``flock`` on a hidden lock file, held until ``release``.

    The lock file exists only while the lock is held: a process that locked a file another one has just
    removed sees that the path names another file (or none) and tries again, so two holders never coexist.
    """

    def __init__(self, path: Path, busy_message: str):
        self.path = path
        self._fd: int | None = None
        for _ in range(5):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise FlashcpError(busy_message) from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                hold_lock(fd)
                return
            os.close(fd)  # the holder removed it as we opened it: take the lock on the new file
        raise FlashcpError(busy_message)

    def release(self) -> None:
        """Remove the lock file and let others take the lock."""
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            drop_lock(self._fd)
            os.close(self._fd)
            self._fd = None


# ---- cheap identity of a Parquet file: size plus a hash of its footer ----

FOOTER_MAX_BYTES = 1 << 24


def parquet_fingerprint(path: str | os.PathLike) -> tuple[int, str]:
    """``(size in bytes, sha256 of the Parquet footer)`` with one small read at the file's end.

    The footer holds the schema, every column chunk's offset and compressed size and the row counts, so a
    file replaced by other data (even with the same number of rows) gets another fingerprint. Raises
    ValueError when the file does not end like Parquet (truncated or not Parquet at all).
    """
    footer = parquet_footer(path)
    return footer.size, footer.sha256


@dataclass(frozen=True, kw_only=True, slots=True)
class ParquetFooter:
    """What one small read at a Parquet file's end tells: its identity and its own record of itself."""

    size: int
    """File size in bytes."""
    sha256: str
    """sha256 of the footer (``parquet_fingerprint``)."""
    num_rows: int
    """Rows, as the footer records them."""
    metadata: dict[bytes, bytes]
    """The footer's key-value metadata (``ARROW:schema``, and what flashcp writes beside it)."""


def parquet_footer(path: str | os.PathLike) -> ParquetFooter:
    """The file's ``ParquetFooter`` (one small read); ValueError when it does not end like Parquet."""
    size, footer = _read_footer(path)
    try:
        metadata = pq.read_metadata(pa.BufferReader(footer))
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"its Parquet footer cannot be parsed ({e})") from None
    return ParquetFooter(size=size, sha256=hashlib.sha256(footer).hexdigest(), num_rows=metadata.num_rows,
                         metadata=dict(metadata.metadata or {}))


def _read_footer(path: str | os.PathLike) -> tuple[int, bytes]:
    """``(file size, footer + its 8-byte tail)``."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 12:
            raise ValueError(f"{size} bytes is too short for a Parquet file")
        f.seek(size - 8)
        tail = f.read(8)
        footer_len = int.from_bytes(tail[:4], "little")
        if tail[4:] != b"PAR1" or footer_len > min(size - 12, FOOTER_MAX_BYTES):
            raise ValueError("it does not end with a Parquet footer (truncated or not Parquet)")
        f.seek(size - 8 - footer_len)
        footer = f.read(footer_len)
    return size, footer + tail
