"""Paths a user names for flashcp to write (``--ckpt``, ``--json FILE``, ``--plot FILE``, ``--profile-out``).

One set of rules for every such option, checked before the command does any work:

- **Never inside a dataset.** A path in (or at) a folder holding a flashcp ``manifest.json`` or an unfinished
  pack's ``pack-state.json`` is refused: a dataset is written only by ``pack``, ``synth`` and ``plan``.
- **Only flashcp's own output is replaced.** A path that already holds something is refused with one sentence
  (a folder where a file goes, a file where a folder goes, a symlink, a FIFO, a file of another kind) unless
  it is recognisably flashcp's own output of the same kind (``OutputKind.recognise``: the ``format`` field of
  a JSON report, the ``Software`` text chunk of a PNG, a checkpoint's own layout), which is then replaced:
  that is what each of these options documents (a checkpoint is rewritten at every save, a report or plot
  by the next run that names it).
- **Atomic.** The new file is written under a temporary name beside the path, fsynced and renamed onto it
  (``flashcp.fileio.atomic_path``): a failed or killed run leaves what was there byte-identical.
- **Marked staging.** A staging or backup folder flashcp makes beside a user's path (a sharded checkpoint's
  ``.NAME.staging``, a synth run's hidden folder) gets a marker file (``MARKER_NAME``) the moment it is
  created, and is deleted only when that marker is there (or the folder is empty), never by its name alone.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flashcp.errors import FlashcpError
from flashcp.fileio import atomic_path

__all__ = ["MARKER_NAME", "OutputKind", "check_output", "check_removable", "check_script_output",
           "enclosing_dataset", "folder_json", "is_marked", "json_report", "make_marked_dir", "mark_dir", "png_plot",
           "remove_marked", "write_json_output", "write_output"]

MARKER_NAME = ".flashcp-made"
"""The file that proves flashcp made a staging or backup folder."""
_MARKER_FORMAT = "flashcp-made"
_DATASET_FILES = ("manifest.json", "pack-state.json")
PNG_SOFTWARE = "flashcp"
"""What flashcp's PNG plots say in their ``Software`` text chunk (``png_plot`` recognises it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputKind:
    """One kind of file (or folder) that an option writes at a path the user names."""

    what: str
    """What it is, with its article, as a sentence names it: ``"a flashcp checkpoint"``."""
    option: str
    """The option naming the path, e.g. ``--json``."""
    recognise: Callable[[Path], bool]
    """True when the existing entry at a path is flashcp's own output of this kind (never raises)."""
    folder: bool = False
    """The output is a folder (a sharded checkpoint) rather than one file."""


def enclosing_dataset(path: str | os.PathLike) -> Path | None:
    """The flashcp dataset folder that ``path`` is (or lies inside), or None.

    Symlinks are resolved first, so a link into a dataset counts as inside it. A folder counts when it holds a
    ``manifest.json`` whose ``format`` is flashcp's, or the ``pack-state.json`` of an unfinished pack.
    """
    resolved = Path(os.path.realpath(path))
    for folder in (resolved, *resolved.parents):
        if _is_dataset(folder):
            return folder
    return None


def _is_dataset(folder: Path) -> bool:
    for name, wanted in zip(_DATASET_FILES, ("flashcp-dataset", "flashcp-pack-state")):
        try:
            with open(folder / name, "rb") as f:
                head = f.read(1 << 16)
        except OSError:
            continue
        if f'"format": "{wanted}"'.encode() in head or f'"format":"{wanted}"'.encode() in head:
            return True
        try:
            value = json.loads(Path(folder / name).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if isinstance(value, dict) and value.get("format") == wanted:
            return True
    return False


def check_output(path: str | os.PathLike, kind: OutputKind) -> Path:
    """``path`` as a Path when flashcp may write ``kind`` there; one-sentence FlashcpError otherwise.

    Call it before the command does any work, so that a refusal costs nothing. See the module docstring.
    """
    path = Path(path)
    label = f"{kind.option} {path}"
    dataset = enclosing_dataset(path)
    if dataset is not None:
        where = "is the dataset" if dataset == Path(os.path.realpath(path)) else "lies inside the dataset"
        raise FlashcpError(f"{label} {where} {dataset}; only pack, synth and plan write a dataset: choose a "
                           "path outside it")
    if path.is_symlink():
        raise FlashcpError(f"{label} is a symlink (to {os.readlink(path)}); flashcp does not write through "
                           "symlinks: name the file itself or another path")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        _check_parent(path, label)
        return path
    except OSError as e:
        raise FlashcpError(f"cannot access {label}: {e.strerror or e}") from None
    if kind.folder and not stat.S_ISDIR(mode):
        raise FlashcpError(f"{label} exists and is not a folder (it should hold {kind.what}); move it away or "
                           "choose another path")
    if not kind.folder and stat.S_ISDIR(mode):
        raise FlashcpError(f"{label} is a folder, and {kind.what} is one file: name a file")
    if not kind.folder and not stat.S_ISREG(mode):
        raise FlashcpError(f"{label} exists and is not a regular file; choose another path")
    if not kind.recognise(path):
        raise FlashcpError(f"{label} exists and is not {kind.what}; flashcp replaces only its own files: move "
                           "it away or choose another path")
    return path


def check_script_output(path: str | os.PathLike, kind: OutputKind) -> Path:
    """``check_output`` for a script under ``bench/``: a refusal ends the process (exit 1, one sentence on stderr).

    The scripts write their reports through the same rules as the commands' ``--json FILE``; call it before
    the script does any work.
    """
    try:
        return check_output(path, kind)
    except FlashcpError as e:
        raise SystemExit(f"error: {e}") from None


def _check_parent(path: Path, label: str) -> None:
    """FlashcpError when the folder that would hold ``path`` cannot be one (a file stands in its way)."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise FlashcpError(f"cannot write {label}: {parent} is a file, not a folder")
            return


def write_output(path: str | os.PathLike, kind: OutputKind, write: Callable[[Path], object]) -> Path:
    """Check ``path`` (``check_output``) and write it atomically: ``write(tmp)`` fills a temporary file beside it."""
    path = check_output(path, kind)
    with atomic_path(path) as tmp:
        write(tmp)
    return path


def write_json_output(path: str | os.PathLike, kind: OutputKind, obj) -> Path:
    """``write_output`` of ``obj`` as indented JSON (a report: NaN is written as JSON's usual ``NaN``)."""
    text = json.dumps(obj, indent=2) + "\n"
    return write_output(path, kind, lambda tmp: tmp.write_text(text))


def json_report(format_name: str, what: str, option: str = "--json",
                legacy: Callable[[dict], bool] | None = None) -> OutputKind:
    """The kind of a JSON report whose top-level ``format`` is ``format_name``.

    ``legacy`` also recognises reports flashcp wrote before they carried ``format`` (by their keys).
    """
    def recognise(path: Path) -> bool:
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            return False
        if not isinstance(value, dict):
            return False
        return value.get("format") == format_name or (legacy is not None and "format" not in value
                                                      and legacy(value))

    return OutputKind(what=what, option=option, recognise=recognise)


def png_plot(what: str, option: str = "--plot") -> OutputKind:
    """The kind of a PNG that flashcp drew (its ``Software`` text chunk starts with ``PNG_SOFTWARE``)."""
    return OutputKind(what=what, option=option, recognise=_flashcp_png)


def _flashcp_png(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                return False
            while header := f.read(8):
                if len(header) < 8:
                    return False
                size, chunk = int.from_bytes(header[:4], "big"), header[4:]
                if chunk == b"IDAT" or chunk == b"IEND" or size > 1 << 20:
                    return False  # text chunks before the image data only, as matplotlib writes them
                body = f.read(size)
                f.read(4)  # CRC
                if chunk == b"tEXt":
                    key, _, value = body.partition(b"\0")
                    if key == b"Software" and value.startswith(PNG_SOFTWARE.encode()):
                        return True
    except OSError:
        return False
    return False


# ---- staging and backup folders beside a user's path ----

def make_marked_dir(path: Path, what: str) -> Path:
    """Create the folder ``path`` (it must not exist) and mark it as flashcp's at once."""
    path.mkdir()
    mark_dir(path, what)
    return path


def mark_dir(path: Path, what: str) -> None:
    """Put the marker into ``path``, a folder flashcp made (or a checkpoint it wrote, about to be moved aside)."""
    text = json.dumps({"format": _MARKER_FORMAT, "what": what}) + "\n"
    with atomic_path(path / MARKER_NAME) as tmp:  # never seen half-written
        tmp.write_text(text)


def folder_json(path: Path, name: str) -> dict | None:
    """The JSON object in the file ``name`` of the folder ``path``, or None (never raises).

    None when ``path`` is not a real folder (a symlink is not) or the file is missing, unreadable or not a JSON
    object.
    """
    if path.is_symlink() or not path.is_dir():
        return None
    try:
        value = json.loads((path / name).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def is_marked(path: Path) -> bool:
    """True when ``path`` is a real folder (not a symlink) holding flashcp's marker."""
    marker = folder_json(path, MARKER_NAME)
    return marker is not None and marker.get("format") == _MARKER_FORMAT


def check_removable(path: Path, what: str) -> None:
    """FlashcpError (one sentence) when ``path`` exists and is not a staging folder flashcp may delete.

    A folder is flashcp's when it holds the marker, or is empty (a run killed right after creating it); a
    missing path is fine. ``what`` names what the folder is in the way of.
    """
    if not os.path.lexists(path) or is_marked(path) or _empty_dir(path):
        return
    raise FlashcpError(f"{path} is in the way of {what}, and flashcp did not make it (no {MARKER_NAME} "
                       "inside); flashcp deletes only its own staging folders: move it away and re-run")


def remove_marked(path: Path, what: str) -> None:
    """Delete the staging or backup folder ``path`` if flashcp made it (``check_removable``); refuse otherwise."""
    check_removable(path, what)
    if is_marked(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.rmdir()


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
