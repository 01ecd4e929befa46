"""Input discovery and streaming readers for ``flashcp pack``: JSONL (plain or gzip), Parquet and plain text.

Inputs are found in a fixed order: the arguments as given; inside a folder, files sorted by their path
relative to it (hidden entries skipped). Documents then stream out one record at a time, so memory never holds
more than one record (one Parquet batch), whatever the size of the input.

A *record* is one JSONL line, one Parquet row, or one whole text file. A record either holds a document's text
or is bad; bad records are skipped and counted by reason (``SKIP_REASONS``), or raise under ``strict``.
Every record has a position ``(input_index, record_index)`` (the line number, the row number, 0 for a text
file), so that a resumed run can start reading exactly where an earlier one stopped.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from flashcp.errors import FlashcpError

__all__ = [
    "DOC",
    "FORMATS",
    "SKIP_REASONS",
    "InputFile",
    "bad_record_error",
    "discover_inputs",
    "iter_records",
    "parse_jsonl_line",
]

FORMATS = {".jsonl.gz": "jsonl.gz", ".jsonl": "jsonl", ".parquet": "parquet", ".txt": "text"}
"""File name ending -> input format; files matching an ``include`` glob are read as ``text``."""

DOC = 0
"""Record kind of a record holding a document; other kinds index ``SKIP_REASONS`` from 1."""

SKIP_REASONS = ("invalid_utf8", "invalid_json", "missing_field", "not_text")
"""Why a record was skipped: bytes that are not UTF-8, a line that is not a JSON object, no value (or null)
under the text field, a value that is not a string. Kind ``k`` (>= 1) is ``SKIP_REASONS[k - 1]``."""

_INVALID_UTF8, _INVALID_JSON, _MISSING_FIELD, _NOT_TEXT = 1, 2, 3, 4

_REASON_SENTENCES = {
    _INVALID_UTF8: "holds bytes that are not valid UTF-8",
    _INVALID_JSON: "is not a JSON object",
    _MISSING_FIELD: "has no value under the text field '{field}'",
    _NOT_TEXT: "has a value under '{field}' that is not a string",
}

_PARQUET_BATCH_ROWS = 1024
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


@dataclass(frozen=True, kw_only=True, slots=True)
class InputFile:
    """One input file, in the order documents are read."""

    path: Path
    """Absolute path."""
    format: str
    """One of ``FORMATS``' values."""
    bytes: int
    """File size."""


def _format_of(path: Path, include: tuple[str, ...], rel: str) -> str | None:
    name = path.name.lower()
    for ending, fmt in FORMATS.items():
        if name.endswith(ending):
            return fmt
    if any(fnmatch.fnmatch(path.name, g) or fnmatch.fnmatch(rel, g) for g in include):
        return "text"
    return None


def _excluded(name: str, rel: str, exclude: tuple[str, ...]) -> bool:
    return name.startswith(".") or any(fnmatch.fnmatch(name, g) or fnmatch.fnmatch(rel, g) for g in exclude)


def _walk(folder: Path, include: tuple[str, ...], exclude: tuple[str, ...],
          skip: frozenset[Path]) -> list[tuple[Path, str]]:
    """Files under ``folder`` with a known format, sorted by relative path; hidden, excluded ones pruned."""
    found: list[tuple[tuple[str, ...], Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(folder, onerror=_raise_walk_error):
        rel_dir = Path(dirpath).relative_to(folder)
        dirnames[:] = [d for d in dirnames if not _excluded(d, (rel_dir / d).as_posix(), exclude)
                       and (Path(dirpath) / d).resolve() not in skip]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if _excluded(name, rel, exclude):
                continue
            path = Path(dirpath) / name
            fmt = _format_of(path, include, rel)
            if fmt is not None and path.is_file():
                found.append((Path(rel).parts, path, fmt))
    found.sort(key=lambda item: item[0])
    return [(path, fmt) for _, path, fmt in found]


def _raise_walk_error(error: OSError) -> None:
    raise FlashcpError(f"cannot list input folder {error.filename}: {error.strerror}")


def discover_inputs(args: list[str] | tuple[str, ...], *, include: tuple[str, ...] = (),
                    exclude: tuple[str, ...] = (),
                    skip: tuple[Path, ...] = ()) -> tuple[list[InputFile], list[str]]:
    """Expand input arguments (files, folders, globs) into the ordered list of input files.

    Folders are searched recursively for ``.jsonl``, ``.jsonl.gz``, ``.parquet`` and ``.txt`` files and for
    files matching an ``include`` glob (read as plain text, one document per file); entries whose name starts
    with ``.`` or that match an ``exclude`` glob are skipped. Globs match the file name or the path relative
    to the folder; nothing inside the folders in ``skip`` (the output) is read. Returns
    ``(inputs, warnings)``; a file reached twice is read once, with a warning.
    Raises FlashcpError for a missing input, a file of unknown format, or a folder or pattern with no inputs.
    """
    inputs: list[InputFile] = []
    warnings: list[str] = []
    skip_dirs = frozenset(Path(p).resolve() for p in skip)
    seen: set[Path] = set()

    def add(path: Path, fmt: str) -> None:
        path = path.resolve()
        if skip_dirs and not skip_dirs.isdisjoint(path.parents):
            return  # inside the output folder
        if path in seen:
            warnings.append(f"input {path} is listed more than once; it is read once")
            return
        seen.add(path)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise FlashcpError(f"cannot read input {path}: {e.strerror}") from None
        inputs.append(InputFile(path=path, format=fmt, bytes=size))

    for arg in args:
        path = Path(arg)
        if path.is_dir():
            files = _walk(path, include, exclude, skip_dirs)
            if not files:
                raise FlashcpError(f"input folder {arg} holds no .jsonl, .jsonl.gz, .parquet or .txt files; "
                                   "add --include GLOB to read other files as plain text")
            for file, fmt in files:
                add(file, fmt)
        elif path.is_file():
            fmt = _format_of(path, include, path.name)
            if fmt is None:
                raise FlashcpError(f"input {arg} is not .jsonl, .jsonl.gz, .parquet or .txt; "
                                   "add --include GLOB to read it as plain text")
            add(path, fmt)
        elif glob.has_magic(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            taken = 0
            for match in matches:
                match_path = Path(match)
                if match_path.is_dir():
                    for file, fmt in _walk(match_path, include, exclude, skip_dirs):
                        add(file, fmt)
                        taken += 1
                elif (fmt := _format_of(match_path, include, match_path.name)) is not None:
                    add(match_path, fmt)
                    taken += 1
            if not taken:
                raise FlashcpError(f"input pattern {arg} matches no .jsonl, .jsonl.gz, .parquet or .txt "
                                   "files")
        elif path.exists():
            raise FlashcpError(f"input {arg} is neither a file nor a folder")
        else:
            raise FlashcpError(f"input {arg} does not exist")
    return inputs, warnings


def _bad(kind: int, input_file: InputFile, where: str, field: str) -> FlashcpError:
    sentence = _REASON_SENTENCES[kind].format(field=field)
    return FlashcpError(f"{input_file.path} {where} {sentence} (--strict makes every bad record fatal; "
                        "without it bad records are skipped and counted)")


def _jsonl_records(index: int, input_file: InputFile, field: str, start: int,
                   strict: bool) -> Iterator[tuple[int, int, int, str | None]]:
    opener = gzip.open if input_file.format == "jsonl.gz" else open
    try:
        with opener(input_file.path, "rb") as f:
            for line_no, line in enumerate(f):
                if line_no < start or not line.strip():
                    continue
                kind, text = parse_jsonl_line(line, field)
                if kind != DOC and strict:
                    raise _bad(kind, input_file, f"line {line_no + 1}", field)
                yield index, line_no, kind, text
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise FlashcpError(f"input {input_file.path} is not a readable gzip file ({e})") from None
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None


def parse_jsonl_line(line: bytes, field: str) -> tuple[int, str | None]:
    """``(kind, text)`` of one non-blank JSONL line: ``(DOC, text)`` or a skip reason code and None."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        return _INVALID_UTF8, None
    except ValueError:
        return _INVALID_JSON, None
    if not isinstance(obj, dict):
        return _INVALID_JSON, None
    if (value := obj.get(field)) is None:
        return _MISSING_FIELD, None
    if not isinstance(value, str):
        return _NOT_TEXT, None
    if not value.isascii() and not _encodable(value):
        return _INVALID_UTF8, None  # lone surrogates from \ud800-style escapes
    return DOC, value


def bad_record_error(kind: int, input_file: InputFile, record_index: int, field: str) -> FlashcpError:
    """The error ``--strict`` raises for bad record ``record_index`` of ``input_file`` (as the readers word it)."""
    where = {"parquet": f"row {record_index}", "text": "(plain text)"}.get(input_file.format,
                                                                          f"line {record_index + 1}")
    return _bad(kind, input_file, where, field)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_records(index: int, input_file: InputFile, field: str, start: int,
                     strict: bool) -> Iterator[tuple[int, int, int, str | None]]:
    try:
        pf = pq.ParquetFile(input_file.path)
    except (OSError, pa.ArrowException) as e:
        raise FlashcpError(f"input {input_file.path} is not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise FlashcpError(f"input {input_file.path} has no column '{field}' "
                           f"(it has: {', '.join(schema.names)}); choose the column with --text-field")
    if schema.field(field).type not in _TEXT_TYPES:
        raise FlashcpError(f"column '{field}' of input {input_file.path} holds {schema.field(field).type}, "
                           "not text")
    metadata = pf.metadata
    first_group, row = 0, 0
    while first_group < metadata.num_row_groups and row + metadata.row_group(first_group).num_rows <= start:
        row += metadata.row_group(first_group).num_rows
        first_group += 1
    groups = list(range(first_group, metadata.num_row_groups))
    if not groups:
        return
    try:
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=groups, columns=[field]):
            # as bytes, so that invalid UTF-8 costs one record, not the whole batch
            values = batch.column(0).cast(pa.large_binary()).to_pylist()
            for raw in values:
                if row >= start:
                    kind, text = DOC, None
                    if raw is None:
                        kind = _MISSING_FIELD
                    else:
                        try:
                            text = raw.decode("utf-8")
                        except UnicodeDecodeError:
                            kind = _INVALID_UTF8
                    if kind != DOC and strict:
                        raise _bad(kind, input_file, f"row {row}", field)
                    yield index, row, kind, text
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise FlashcpError(f"input {input_file.path} is not a readable Parquet file ({e})") from None


def _text_records(index: int, input_file: InputFile, field: str, start: int,
                  strict: bool) -> Iterator[tuple[int, int, int, str | None]]:
    if start > 0:
        return
    try:
        raw = input_file.path.read_bytes()
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None
    if not raw:
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        if strict:
            raise _bad(_INVALID_UTF8, input_file, "(plain text)", field) from None
        yield index, 0, _INVALID_UTF8, None
        return
    yield index, 0, DOC, text


_READERS = {"jsonl": _jsonl_records, "jsonl.gz": _jsonl_records, "parquet": _parquet_records,
            "text": _text_records}


def iter_records(inputs: list[InputFile], *, text_field: str = "text", start: tuple[int, int] = (0, 0),
                 strict: bool = False) -> Iterator[tuple[int, int, int, str | None]]:
    """Stream ``(input_index, record_index, kind, text)`` over all inputs from position ``start``.

    ``kind`` is ``DOC`` (``text`` is the document, possibly empty) or a skip reason code (``text`` is None;
    ``SKIP_REASONS[kind - 1]`` names it). Blank JSONL lines and empty files yield nothing. With ``strict`` the
    first bad record raises FlashcpError instead. A file that cannot be read raises FlashcpError.
    """
    first_input, first_record = start
    for index in range(first_input, len(inputs)):
        input_file = inputs[index]
        reader = _READERS[input_file.format]
        yield from reader(index, input_file, text_field, first_record if index == first_input else 0, strict)
