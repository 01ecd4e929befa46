"""Input discovery and streaming readers for ``flashcp pack``: JSONL (plain or gzip), Parquet and plain text.

Inputs are found in a fixed order: the arguments as given; inside a folder, files sorted by their path
relative to it (hidden entries skipped). Documents then stream out one record at a time, so memory never holds
more than one record (one Parquet batch), whatever the size of the input.

Inputs are hashed as they are read: ``hash_input`` records each input's sha256 and a stamp (device, inode,
size, modification and change times) taken through one descriptor; every reader then checks the stamp when
it opens the file, and once it has read the file to its end, that what it read is what was hashed (JSONL,
gzip and text files are hashed while they are read; a Parquet file, which is read a column at a time, is
re-hashed through the same descriptor). An input that changed is refused with one sentence
(``InputChanged``) instead of being recorded with the hash of other content.

A *record* is one JSONL line, one Parquet row, or one whole text file. A record either holds a document's text
or is bad; bad records are skipped and counted by reason (``SKIP_REASONS``), or raise under ``strict``.
Every record has a position ``(input_index, record_index)`` (the line number, the row number, 0 for a text
file), so that a resumed run can start reading exactly where an earlier one stopped.
"""

from __future__ import annotations

import fnmatch
import glob
import gzip
import hashlib
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from flashcp.errors import FlashcpError

__all__ = [
    "DOC",
    "FORMATS",
    "SKIP_REASONS",
    "InputChanged",
    "InputFile",
    "bad_record_error",
    "check_stamp",
    "discover_inputs",
    "hash_input",
    "iter_records",
    "parse_jsonl_line",
    "read_records",
    "recheck_input",
    "skipped_note",
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
    sha256: str | None = None
    """Hex sha256 of the content (``hash_input``); readers check that what they read matches it."""
    stamp: tuple[int, ...] | None = None
    """``(device, inode, size, mtime_ns, ctime_ns)`` when it was hashed; readers check it when they open it."""


class InputChanged(FlashcpError):
    """An input whose content or stamp differs from when ``pack`` hashed it."""

    def __init__(self, path: Path, detail: str):
        self.path, self.detail = path, detail
        super().__init__(f"input {path} changed while flashcp pack was reading it ({detail}); nothing is "
                         "recorded from it: re-run the pack once the input no longer changes")

    def __reduce__(self):
        return InputChanged, (self.path, self.detail)  # raised in Ray tasks, re-raised on the driver


_READ_BYTES = 1 << 22


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_stamp(input_file: InputFile, st: os.stat_result) -> None:
    """InputChanged unless ``st`` (an fstat of the input) matches the stamp taken when it was hashed."""
    if input_file.stamp is None:
        return
    now = _stamp(st)
    if now[:2] != input_file.stamp[:2]:
        raise InputChanged(input_file.path, "it was replaced by another file after it was hashed")
    if now[2] != input_file.stamp[2]:
        raise InputChanged(input_file.path, f"it had {input_file.stamp[2]:,} bytes when it was hashed and has "
                                            f"{now[2]:,} now")
    if now != input_file.stamp:
        raise InputChanged(input_file.path, "it was written to after it was hashed (its modification time changed)")


def _hash_fd(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    f.seek(0)
    while chunk := f.read(_READ_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def hash_input(input_file: InputFile) -> InputFile:
    """``input_file`` with its sha256, size and stamp, read through one descriptor.

    Raises FlashcpError when it cannot be read, and InputChanged when it changes while it is being hashed.
    """
    try:
        with open(input_file.path, "rb") as f:
            before = os.fstat(f.fileno())
            digest = _hash_fd(f)
            after = os.fstat(f.fileno())
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None
    if _stamp(before) != _stamp(after):
        raise InputChanged(input_file.path, "it changed while it was being hashed")
    return replace(input_file, bytes=after.st_size, sha256=digest, stamp=_stamp(after))


def recheck_input(input_file: InputFile) -> None:
    """InputChanged unless the input still has the stamp and sha256 it was hashed with (after reading it)."""
    if input_file.sha256 is None:
        return
    try:
        with open(input_file.path, "rb") as f:
            check_stamp(input_file, os.fstat(f.fileno()))
            digest = _hash_fd(f)
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None
    if digest != input_file.sha256:
        raise InputChanged(input_file.path, "its content no longer matches the sha256 taken when it was hashed")


class _HashingReader:
    """A binary file that hashes every byte read from it (for ``gzip.GzipFile(fileobj=...)``)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        """Refused: the hash must see every byte once, in order (gzip seeks only to rewind; flashcp never does)."""
        raise io.UnsupportedOperation("a hashing reader reads forward only")

    def finish(self) -> str:
        """Hash the rest (anything the reader left unread) and return the hex digest."""
        while self.read(_READ_BYTES):
            pass
        return self.digest.hexdigest()


def _lines(reader: _HashingReader) -> Iterator[bytes]:
    """The lines of a binary file, split where ``for line in f`` splits them but without the newline.

    Read in large blocks through ``reader`` (which hashes them).
    """
    pending: list[bytes] = []
    while chunk := reader.read(_READ_BYTES):
        parts = chunk.split(b"\n")
        if pending:
            parts[0] = b"".join([*pending, parts[0]])
            pending = []
        last = parts.pop()
        yield from parts
        if last:
            pending.append(last)
    if pending:
        yield b"".join(pending)


def _check_read(input_file: InputFile, digest: str | None, f: BinaryIO) -> None:
    """After reading ``input_file`` to its end through ``f``: it is what was hashed, and still unchanged."""
    if input_file.sha256 is not None and digest != input_file.sha256:
        raise InputChanged(input_file.path, "what was read does not match the sha256 taken when it was hashed")
    check_stamp(input_file, os.fstat(f.fileno()))


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


def _ending(name: str) -> str:
    """How a file name ends, as the skipped-files note groups it: ``.md``, ``.tar.gz``, or ``no extension``."""
    suffixes = Path(name.lower()).suffixes[-2:]
    if len(suffixes) == 2 and suffixes[1] in (".gz", ".bz2", ".xz", ".zst"):
        return "".join(suffixes)
    return suffixes[-1] if suffixes else "no extension"


_TEXT_LIKE = frozenset((".md", ".rst", ".py", ".html", ".htm", ".tex", ".json", ".xml", ".toml", ".yaml", ".yml",
                        ".csv", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".js", ".ts", ".sh"))
"""Endings of text files: the note's example of an --include takes the most common of these."""


def skipped_note(skipped: Counter) -> str | None:
    """One sentence on the files of input folders that were not read, by ending, and how to read them."""
    if not skipped:
        return None
    kinds = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))  # the same order on every machine
    shown = ", ".join(f"{count:,} {ending}" for ending, count in kinds[:6])
    more = f" and {len(kinds) - 6} more kinds" if len(kinds) > 6 else ""
    example = next((e for e, _ in kinds if e in _TEXT_LIKE), ".md")  # never suggest reading .pyc or .so
    return (f"not read: {sum(skipped.values()):,} file(s) of the input folders that are not .jsonl, .jsonl.gz, "
            f".parquet or .txt ({shown}{more}); --include GLOB reads such files as plain text, one document per "
            f"file (e.g. --include '*{example}')")


def _walk(folder: Path, include: tuple[str, ...], exclude: tuple[str, ...],
          skip: frozenset[Path], skipped: Counter | None = None) -> list[tuple[Path, str]]:
    """Files under ``folder`` with a known format, sorted by relative path; hidden, excluded ones pruned.

    ``skipped`` counts the other regular files (not hidden, not excluded) by how their names end.
    """
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
            elif fmt is None and skipped is not None and path.is_file():
                skipped[_ending(name)] += 1
    found.sort(key=lambda item: item[0])
    return [(path, fmt) for _, path, fmt in found]


def _raise_walk_error(error: OSError) -> None:
    raise FlashcpError(f"cannot list input folder {error.filename}: {error.strerror}")


def discover_inputs(args: list[str] | tuple[str, ...], *, include: tuple[str, ...] = (),
                    exclude: tuple[str, ...] = (),
                    skip: tuple[Path, ...] = (),
                    skipped: Counter | None = None) -> tuple[list[InputFile], list[str]]:
    """Expand input arguments (files, folders, globs) into the ordered list of input files.

    Folders are searched recursively for ``.jsonl``, ``.jsonl.gz``, ``.parquet`` and ``.txt`` files and for
    files matching an ``include`` glob (read as plain text, one document per file); entries whose name starts
    with ``.`` or that match an ``exclude`` glob are skipped. Globs match the file name or the path relative
    to the folder; only regular files are read (no FIFOs or devices). Nothing inside the folders in ``skip``
    (the output) is read: a folder search or pattern passes over them, and a file or folder named as an
    argument inside one is refused. Returns ``(inputs, warnings)``; a file reached twice is read once, with a
    warning. ``skipped``, when given, counts the files of folders searched that were not taken, by how their
    names end (``skipped_note`` says it in a sentence). Raises FlashcpError for a missing input, a file of
    unknown format, an input inside the output, or a folder or pattern with no inputs.
    """
    inputs: list[InputFile] = []
    warnings: list[str] = []
    skip_dirs = frozenset(Path(p).resolve() for p in skip)
    seen: set[Path] = set()

    def inside_output(path: Path) -> Path | None:
        return next((d for d in skip_dirs if path == d or d in path.parents), None)

    def add(path: Path, fmt: str) -> None:
        path = path.resolve()
        if inside_output(path) is not None:
            return  # a symlink in an input folder leading into the output
        if path in seen:
            warnings.append(f"input {path} is listed more than once; it is read once")
            return
        seen.add(path)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise FlashcpError(f"cannot read input {path}: {e.strerror}") from None
        inputs.append(InputFile(path=path, format=fmt, bytes=size))

    def refuse_inside(arg: str, path: Path) -> None:
        output = inside_output(path.resolve())
        if output is not None:
            raise FlashcpError(f"input {arg} lies inside the output folder {output}; flashcp does not read the "
                               "dataset it writes: name inputs outside it, or another output folder")

    for arg in args:
        path = Path(arg)
        if path.is_dir():
            refuse_inside(arg, path)
            files = _walk(path, include, exclude, skip_dirs, skipped)
            if not files:
                raise FlashcpError(f"input folder {arg} holds no .jsonl, .jsonl.gz, .parquet or .txt files; "
                                   "add --include GLOB to read other files as plain text")
            for file, fmt in files:
                add(file, fmt)
        elif path.is_file():
            refuse_inside(arg, path)
            file_fmt = _format_of(path, include, path.name)
            if file_fmt is None:
                raise FlashcpError(f"input {arg} is not .jsonl, .jsonl.gz, .parquet or .txt; "
                                   "add --include GLOB to read it as plain text")
            add(path, file_fmt)
        elif glob.has_magic(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            taken = 0
            for match in matches:
                match_path = Path(match)
                if inside_output(match_path.resolve()) is not None:
                    continue  # a pattern reaching into the output (e.g. '*' beside it): not an input
                if match_path.is_dir():
                    for file, fmt in _walk(match_path, include, exclude, skip_dirs, skipped):
                        add(file, fmt)
                        taken += 1
                elif (match_fmt := _format_of(match_path, include, match_path.name)) is not None \
                        and match_path.is_file():  # as in folders: no FIFOs or devices (reading one blocks)
                    add(match_path, match_fmt)
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
    try:
        with open(input_file.path, "rb") as raw:
            check_stamp(input_file, os.fstat(raw.fileno()))
            reader = _HashingReader(raw)
            gz = gzip.GzipFile(fileobj=reader, mode="rb") if input_file.format == "jsonl.gz" else None
            for line_no, line in enumerate(gz if gz is not None else _lines(reader)):
                if line_no < start or not line.strip():
                    continue
                kind, text = parse_jsonl_line(line, field)
                if kind != DOC and strict:
                    raise _bad(kind, input_file, f"line {line_no + 1}", field)
                yield index, line_no, kind, text
            _check_read(input_file, reader.finish(), raw)
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
    except (ValueError, RecursionError):  # RecursionError: nested thousands of levels deep
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
        source = open(input_file.path, "rb")
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None
    with source:
        check_stamp(input_file, os.fstat(source.fileno()))
        yield from _parquet_rows(index, input_file, field, start, strict, source)
        try:  # read to its end: what pyarrow read (through ``source``) is what was hashed
            _check_read(input_file, _hash_fd(source) if input_file.sha256 is not None else None, source)
        except OSError as e:
            raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None


def _parquet_rows(index: int, input_file: InputFile, field: str, start: int, strict: bool,
                  source: BinaryIO) -> Iterator[tuple[int, int, int, str | None]]:
    try:
        pf = pq.ParquetFile(source)
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
        with open(input_file.path, "rb") as f:
            check_stamp(input_file, os.fstat(f.fileno()))
            raw = f.read()
            _check_read(input_file, hashlib.sha256(raw).hexdigest(), f)
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


def read_records(input_file: InputFile, *, index: int = 0, text_field: str = "text", start: int = 0,
                 strict: bool = False) -> Iterator[tuple[int, int, int, str | None]]:
    """Stream ``(index, record_index, kind, text)`` over one input file from record ``start`` on.

    ``index`` is the input's index to report; records and errors are those of ``iter_records``.
    """
    return _READERS[input_file.format](index, input_file, text_field, start, strict)


def iter_records(inputs: list[InputFile], *, text_field: str = "text", start: tuple[int, int] = (0, 0),
                 strict: bool = False) -> Iterator[tuple[int, int, int, str | None]]:
    """Stream ``(input_index, record_index, kind, text)`` over all inputs from position ``start``.

    ``kind`` is ``DOC`` (``text`` is the document, possibly empty) or a skip reason code (``text`` is None;
    ``SKIP_REASONS[kind - 1]`` names it). Blank JSONL lines and empty files yield nothing. With ``strict`` the
    first bad record raises FlashcpError instead. A file that cannot be read raises FlashcpError.
    """
    first_input, first_record = start
    for index in range(first_input, len(inputs)):
        yield from read_records(inputs[index], index=index, text_field=text_field,
                                start=first_record if index == first_input else 0, strict=strict)
