"""``flashcp pack``: text files in, a packed dataset out (docs/DESIGN.md sections 4 and 5).

The pipeline streams: the main process reads records in input order and groups them into batches; batches are
tokenized in order (in ``workers`` processes, at most a few batches in flight, so memory stays bounded); the
main process packs the ids into sequences (``flashcp.data.packing``) and writes them to data files of
``rows_per_file`` rows in row groups of ``row_group_rows``. Batches are made from the records alone, so the
output bytes do not depend on the number of workers.

Counters (``counts`` in the manifest) are positional: at any sequence boundary they cover exactly the records
read up to that point, which is what lets an interrupted run resume after its last finished data file
(``flashcp.data.pack_output``) and still end with the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from flashcp.data.dataset import DataFile, DataFileWriter, data_table, write_manifest
from flashcp.data.pack_output import OutputFolder, PartRecord, prepare_output
from flashcp.data.packing import OVERFLOWS, PackCounts, Packer, Window
from flashcp.data.readers import (
    DOC,
    SKIP_REASONS,
    InputChanged,
    InputFile,
    check_stamp,
    discover_inputs,
    hash_input,
    iter_records,
    skipped_note,
)
from flashcp.data.tokenizer import (
    DEFAULT_TOKENIZER,
    Encoder,
    encode_in_worker,
    init_worker,
    resolve_tokenizer,
    worker_ready,
)
from flashcp.errors import FlashcpError

__all__ = ["PackConfig", "PackEngine", "PackResult", "PackRun", "check_inputs_unchanged", "file_layout", "run_pack"]

ROW_GROUP_TOKENS = 1 << 22
"""Default row group: about 4M tokens (16 MiB of int32 ids before compression)."""
ROW_GROUPS_PER_FILE = 16
"""Default data file: 16 row groups (about 64M tokens); also the unit a resumed run restarts from."""
BATCH_CHARS = 1 << 19
"""Characters of text per tokenization batch."""
BATCH_RECORDS = 4096
"""Records per tokenization batch at most."""
IN_FLIGHT_PER_WORKER = 3
"""Batches queued per worker: enough to keep workers busy while the main process packs and writes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    """Everything ``run_pack`` needs; invalid values raise ValueError."""

    inputs: tuple[str, ...]
    """Files, folders or glob patterns, read in this order."""
    output: Path
    """The dataset folder to write."""
    context_len: int
    """Tokens per packed sequence (at least 2, at most ``flashcp.costmodel.limits.MAX_CONTEXT_LEN``)."""
    tokenizer: str = DEFAULT_TOKENIZER
    """A built-in tokenizer name or the path of a tokenizer.json."""
    text_field: str = "text"
    """JSONL key or Parquet column holding the text."""
    overflow: str = "split"
    """``split``: a document continues in the next sequence; ``truncate``: its rest is dropped."""
    append_eos: bool = True
    """Append the tokenizer's EOS id after every document."""
    include: tuple[str, ...] = ()
    """Globs of further files to read as plain text when searching folders."""
    exclude: tuple[str, ...] = ()
    """Globs of files and folders to skip when searching folders."""
    strict: bool = False
    """Make any bad record fatal instead of skipping and counting it."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in the calling process."""
    rows_per_file: int = 0
    """Sequences per data file; 0 picks ``ROW_GROUPS_PER_FILE`` row groups."""
    row_group_rows: int = 0
    """Sequences per Parquet row group; 0 picks about ``ROW_GROUP_TOKENS`` tokens."""
    force: bool = False
    """Overwrite an existing dataset or unfinished pack in ``output``."""

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("no inputs given; name at least one file, folder or pattern")
        if self.context_len < 2:
            raise ValueError(f"context length must be at least 2 tokens, got {self.context_len}")
        from flashcp.costmodel.limits import check_context_len  # the planner's limit (imports Numba: late)

        check_context_len(self.context_len)
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {self.overflow!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.rows_per_file < 0 or self.row_group_rows < 0:
            raise ValueError("rows per file and rows per row group must be positive (or 0 for automatic)")
        if self.row_group_rows * self.context_len >= 2**31:
            raise ValueError(f"a row group of {self.row_group_rows} sequences of {self.context_len} tokens "
                             "holds 2**31 tokens or more; choose fewer rows per row group")
        if not self.text_field:
            raise ValueError("the text field name is empty")


def file_layout(context_len: int, rows_per_file: int = 0, row_group_rows: int = 0) -> tuple[int, int]:
    """``(rows_per_file, row_group_rows)`` with the automatic defaults filled in."""
    group = row_group_rows or max(1, ROW_GROUP_TOKENS // context_len)
    per_file = rows_per_file or group * ROW_GROUPS_PER_FILE
    return per_file, min(group, per_file)


@dataclass(frozen=True, kw_only=True, slots=True)
class PackResult:
    """What a pack did."""

    manifest: dict
    """The dataset's manifest."""
    resumed_parts: int
    """Data files kept from an interrupted run (0 for a fresh run)."""
    already_done: bool
    """The folder already held this dataset; nothing was written."""
    seconds: float
    """Wall time."""
    warnings: tuple[str, ...] = ()
    """Things the user should know (duplicate or empty inputs, skipped records)."""
    resumed_tokens: int = 0
    """Tokens in the data files kept from an interrupted run (not packed in ``seconds``)."""
    notes: tuple[str, ...] = ()
    """What was left out on purpose: files of the input folders that are not inputs, by ending."""


# ---- tokenization, in order, in worker processes ----

@dataclass(slots=True)
class _Batch:
    texts: list[str] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    records: list[int] = field(default_factory=list)


def _batches(records: Iterator[tuple[int, int, int, str | None]]) -> Iterator[_Batch]:
    batch, chars = _Batch(), 0
    for input_index, record_index, kind, text in records:
        batch.kinds.append(kind)
        batch.inputs.append(input_index)
        batch.records.append(record_index)
        if kind == DOC:
            assert text is not None, "a document record carries its text"
            batch.texts.append(text)
            chars += len(text)
        if chars >= BATCH_CHARS or len(batch.kinds) >= BATCH_RECORDS:
            yield batch
            batch, chars = _Batch(), 0
    if batch.kinds:
        yield batch


def _start_pool(config: PackConfig) -> ProcessPoolExecutor:
    """Start the tokenizer processes now, so that they load while the main process does its own set-up."""
    name = config.tokenizer
    if os.path.exists(name):
        name = str(Path(name).resolve())  # workers resolve it themselves
    pool = ProcessPoolExecutor(config.workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_worker, initargs=(name, config.append_eos, os.getpid()))
    for _ in range(config.workers):
        pool.submit(worker_ready)
    return pool


def _encoded(batches: Iterator[_Batch], encoder: Encoder, pool: ProcessPoolExecutor | None,
             in_flight: int) -> Iterator[tuple[_Batch, np.ndarray, np.ndarray]]:
    """``(batch, tokens, lens)`` in batch order, tokenized here or in the pool, ``in_flight`` queued."""
    if pool is None:
        for batch in batches:
            yield batch, *encoder.encode(batch.texts)
        return
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append((batch, pool.submit(encode_in_worker, batch.texts)))
            if len(pending) >= in_flight:
                done, future = pending.popleft()
                yield done, *future.result()
        while pending:
            done, future = pending.popleft()
            yield done, *future.result()
    except BrokenProcessPool:
        raise FlashcpError("a tokenizer worker process died (out of memory?); try fewer --workers") from None
    finally:
        for _, future in pending:
            future.cancel()


# ---- the run ----

def _new_snapshot() -> dict:
    return {"documents_read": 0, "documents_empty": 0, "tokens_read": 0,
            "records_skipped": dict.fromkeys(SKIP_REASONS, 0), "packer": PackCounts().to_json()}


def _input_documents(parts: list[PartRecord], num_inputs: int) -> list[int]:
    """Documents read per input up to the end of the last part, summed from the parts' deltas."""
    documents = [0] * num_inputs
    for part in parts:
        delta = part.snapshot["input_documents_delta"]
        for i, n in enumerate(delta["counts"], start=delta["first"]):
            documents[i] += n
    return documents


class PackRun:
    """One pass over the inputs from a resume point, writing data files as sequences complete.

    ``run_pack`` makes one (or its engine's ``pack_run``, e.g. the Ray engine's subclass) and calls ``run()``;
    then ``last_file``, ``input_documents`` and ``final_counts`` give what the manifest records.
    """

    def __init__(self, config: PackConfig, encoder: Encoder, pool: ProcessPoolExecutor | None,
                 inputs: list[InputFile], out: OutputFolder, identity: dict, identity_sha256: str,
                 on_rows: Callable[[int], None]):
        self.config, self.encoder, self.pool, self.inputs, self.out = config, encoder, pool, inputs, out
        self.identity, self.identity_sha256, self.on_rows = identity, identity_sha256, on_rows
        self.rows_per_file, self.row_group_rows = file_layout(config.context_len, config.rows_per_file,
                                                              config.row_group_rows)
        last = out.parts[-1] if out.parts else None
        self.resume = last.resume if last else {"input": 0, "record": 0, "offset": 0, "next_doc": 0}
        self.snapshot = copy.deepcopy(last.snapshot) if last else _new_snapshot()
        self.snapshot.pop("input_documents_delta", None)
        # per input, kept apart from the snapshot: a part records only the inputs it read from (its delta)
        self.input_documents = _input_documents(out.parts, len(inputs))
        self.part_first_input = self.resume["input"]
        self.part_first_count = self.input_documents[self.part_first_input]
        self.packer = Packer(config.context_len, config.overflow, PackCounts(**self.snapshot["packer"]))
        self.group: list[Window] = []
        self.writer: DataFileWriter | None = None
        self.last_file: DataFile | None = None  # the trailing file of < rows_per_file rows, not in the state

    def run(self) -> None:
        """Pack everything from the resume point on."""
        counts, skipped = self.snapshot, self.snapshot["records_skipped"]
        input_documents = self.input_documents
        eos = 1 if self.encoder.eos_id is not None else 0
        doc_index, first_offset = self.resume["next_doc"], self.resume["offset"]
        records = iter_records(self.inputs, text_field=self.config.text_field, strict=self.config.strict,
                               start=(self.resume["input"], self.resume["record"]))
        try:
            for batch, tokens, lens in _encoded(_batches(records), self.encoder, self.pool,
                                                IN_FLIGHT_PER_WORKER * self.config.workers):
                at, doc_lens, next_len = 0, lens.tolist(), 0
                for kind, input_index, record_index in zip(batch.kinds, batch.inputs, batch.records):
                    if kind != DOC:
                        skipped[SKIP_REASONS[kind - 1]] += 1
                        continue
                    n = doc_lens[next_len]
                    next_len += 1
                    doc_tokens, at = tokens[at:at + n], at + n
                    start, first_offset = first_offset, 0
                    if start == 0:  # a resumed document was counted by the run that began it
                        counts["documents_read"] += 1
                        input_documents[input_index] += 1
                        if n == eos:
                            counts["documents_empty"] += 1
                            doc_index += 1
                            continue
                        counts["tokens_read"] += n
                    for window in self.packer.add(doc_index, doc_tokens, start):
                        self._accept(window, input_index, record_index, doc_index)
                    doc_index += 1
            self._flush_group()
            if self.writer is not None:
                self.last_file = self.writer.close()
                self.writer = None
        except BaseException:
            if self.writer is not None:
                self.writer.abort()
            raise

    def _accept(self, window: Window, input_index: int, record_index: int, doc_index: int) -> None:
        self.group.append(window)
        rows_in_part = (self.writer.rows if self.writer else 0) + len(self.group)
        if len(self.group) >= self.row_group_rows or rows_in_part >= self.rows_per_file:
            self._flush_group()
        if rows_in_part < self.rows_per_file:
            return
        if window.resume_offset:
            resume = {"input": input_index, "record": record_index, "offset": window.resume_offset,
                      "next_doc": doc_index}
        else:
            resume = {"input": input_index, "record": record_index + 1, "offset": 0,
                      "next_doc": doc_index + 1}
        snapshot = copy.deepcopy(self.snapshot)
        snapshot["packer"] = window.counts.to_json()
        first, docs = self.part_first_input, self.input_documents
        snapshot["input_documents_delta"] = {
            "first": first, "counts": [docs[first] - self.part_first_count, *docs[first + 1:input_index + 1]]}
        self.part_first_input, self.part_first_count = input_index, docs[input_index]
        assert self.writer is not None
        data_file = self.writer.close()
        self.writer = None
        check_inputs_unchanged(self.inputs, first, input_index)  # before the part becomes a resume point
        self.out.parts.append(PartRecord(file=data_file, resume=resume, snapshot=snapshot))
        self.out.write_state(self.identity_sha256, self.identity)

    def _flush_group(self) -> None:
        if not self.group:
            return
        windows, self.group = self.group, []
        lens = [w.doc_lens for w in windows if w.doc_lens is not None]
        assert len(lens) == len(windows), "a token packer's windows carry their pieces"
        pieces = np.array([piece_lens.size for piece_lens in lens], np.int64)
        offsets = np.zeros(len(windows) + 1, np.int64)
        np.cumsum(pieces, out=offsets[1:])
        table = data_table(offsets, np.concatenate(lens),
                           np.concatenate([w.doc_source for w in windows]),
                           np.concatenate([w.doc_offset for w in windows]),
                           np.concatenate([w.tokens for w in windows]), self.config.context_len)
        if self.writer is None:
            self.writer = DataFileWriter(self.out.root, len(self.out.parts))
        self.writer.write(table)
        self.on_rows(len(windows))

    def final_counts(self, num_sequences: int, inputs_empty: int) -> dict:
        """The manifest's ``counts`` once the run is over (the tail is dropped here)."""
        snap, packer = self.snapshot, self.packer.counts
        tail_tokens, tail_documents = self.packer.tail()
        skipped = dict(snap["records_skipped"])
        counts = {
            "documents_read": snap["documents_read"],
            "documents_packed": snap["documents_read"] - snap["documents_empty"] - tail_documents,
            "documents_dropped": snap["documents_empty"] + tail_documents,
            "documents_dropped_empty": snap["documents_empty"],
            "documents_dropped_tail": tail_documents,
            "documents_split": packer.documents_split,
            "documents_truncated": packer.documents_truncated,
            "records_skipped": skipped,
            "records_skipped_total": sum(skipped.values()),
            "inputs_empty": inputs_empty,
            "tokens_read": snap["tokens_read"],
            "tokens_packed": num_sequences * self.config.context_len,
            "tokens_truncated": packer.tokens_truncated,
            "tokens_dropped_tail": tail_tokens,
        }
        accounted = counts["tokens_packed"] + counts["tokens_truncated"] + tail_tokens
        assert counts["tokens_read"] == accounted, counts
        return counts


class PackEngine(Protocol):
    """Another way to run the two heavy steps of a pack (hashing the inputs, tokenizing and packing)."""

    def hash_inputs(self, inputs: list[InputFile]) -> list[InputFile]:
        """The inputs with their sha256 and stamp (``flashcp.data.readers.hash_input``)."""

    def pack_run(self, config: PackConfig, encoder: Encoder, pool: None, inputs: list[InputFile],
                 out: OutputFolder, identity: dict, identity_sha256: str, on_rows: Callable[[int], None]):
        """An object like ``PackRun``: ``run()``, then ``last_file``, ``input_documents``, ``final_counts``."""


def check_inputs_unchanged(inputs: list[InputFile], first: int, last: int) -> None:
    """InputChanged unless inputs ``first..last`` still carry the stamps they were hashed with.

    Called before a finished data file is recorded as a resume point, so that a pack killed after reading
    changed input never resumes from it.
    """
    for input_file in inputs[first:last + 1]:
        try:
            st = os.stat(input_file.path)
        except OSError as e:
            raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None
        check_stamp(input_file, st)


def _input_entry(input_file: InputFile) -> dict:
    """The identity's (and manifest's) entry of a hashed input."""
    return {"path": str(input_file.path), "format": input_file.format, "bytes": input_file.bytes,
            "sha256": input_file.sha256}


def run_pack(config: PackConfig, *, on_rows: Callable[[int], None] = lambda n: None,
             engine: PackEngine | None = None, on_phase: Callable[[str], None] = lambda text: None) -> PackResult:
    """Pack ``config.inputs`` into the dataset folder ``config.output`` and return what was done.

    Resumes an interrupted pack with the same identity; returns at once when the folder already holds this
    dataset. Raises FlashcpError (one sentence) for anything wrong with the inputs, the tokenizer or the
    output folder; a failed run leaves no partial dataset behind. ``on_rows(n)`` is told of every n
    sequences written, ``on_phase(text)`` of each long phase as it starts (hashing the inputs, then tokenizing
    and packing them). With ``workers`` > 1 the workers are started with "spawn", so a script calling this
    needs the usual ``if __name__ == "__main__":`` guard. ``engine`` replaces the local hashing and
    tokenize-and-pack pass (``flashcp.engines.ray_pack``); set-up, resume and the manifest stay these.
    """
    started = time.perf_counter()
    pool = _start_pool(config) if config.workers > 1 and engine is None else None
    try:
        return _run_pack(config, pool, on_rows, started, engine, on_phase)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _run_pack(config: PackConfig, pool: ProcessPoolExecutor | None, on_rows: Callable[[int], None],
              started: float, engine: PackEngine | None = None,
              on_phase: Callable[[str], None] = lambda text: None) -> PackResult:
    spec = resolve_tokenizer(config.tokenizer)
    encoder = Encoder(spec, append_eos=config.append_eos)
    skipped: Counter = Counter()
    inputs, warnings = discover_inputs(config.inputs, include=config.include, exclude=config.exclude,
                                       skip=(config.output,), skipped=skipped)
    notes = tuple(note for note in (skipped_note(skipped),) if note)
    megabytes = sum(i.bytes for i in inputs) / 1e6
    on_phase(f"hashing {len(inputs):,} input file(s), {megabytes:,.1f} MB")
    inputs = engine.hash_inputs(inputs) if engine else [hash_input(i) for i in inputs]
    input_entries = [_input_entry(i) for i in inputs]
    empty = [str(i.path) for i in inputs if i.bytes == 0]
    if empty:
        warnings.append(f"{len(empty)} input file(s) are empty and hold no documents ({empty[0]}"
                        + (", ...)" if len(empty) > 1 else ")"))
    rows_per_file, row_group_rows = file_layout(config.context_len, config.rows_per_file,
                                                config.row_group_rows)
    identity: dict[str, Any] = {
        "context_len": config.context_len,
        "tokenizer": spec.identity(),
        "options": {"text_field": config.text_field, "overflow": config.overflow,
                    "append_eos": config.append_eos, "strict": config.strict,
                    "include": list(config.include), "exclude": list(config.exclude),
                    "rows_per_file": rows_per_file, "row_group_rows": row_group_rows},
        "inputs": input_entries,
    }
    identity_sha256 = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    out = prepare_output(config.output, identity_sha256, identity, force=config.force)
    warnings.extend(out.notes)
    if out.finished is not None:
        out.release()
        return PackResult(manifest=out.finished, resumed_parts=0, already_done=True,
                          seconds=time.perf_counter() - started, warnings=tuple(warnings), notes=notes)
    resumed_parts = len(out.parts)
    resumed_tokens = sum(p.file.tokens for p in out.parts)
    on_phase(f"tokenizing and packing {megabytes:,.1f} MB into sequences of {config.context_len:,} tokens "
             f"(counted as written, {row_group_rows:,} at a time)")
    try:
        out.write_state(identity_sha256, identity)  # from now on the folder is recognisably this pack's
        if engine is not None:  # an engine tokenizes its own way: no pool was started for it
            run = engine.pack_run(config, encoder, None, inputs, out, identity, identity_sha256, on_rows)
        else:
            run = PackRun(config, encoder, pool, inputs, out, identity, identity_sha256, on_rows)
        run.run()
        files = [p.file for p in out.parts] + ([run.last_file] if run.last_file else [])
        num_sequences = sum(f.rows for f in files)
        counts = run.final_counts(num_sequences, len(empty))
        if counts["documents_read"] == 0:
            raise FlashcpError(f"the inputs hold no documents ({counts['records_skipped_total']} bad records "
                               "skipped)")
        if num_sequences == 0:
            raise FlashcpError(f"the inputs hold {counts['tokens_read']} tokens, fewer than one sequence of "
                               f"{config.context_len}; lower --context-len or add inputs")
        documents = run.input_documents
        first = np.concatenate([[0], np.cumsum(documents)[:-1]]).astype(np.int64).tolist()
        manifest_inputs = [{**entry, "documents": n, "first_document": f}
                           for entry, n, f in zip(input_entries, documents, first)]
        manifest = write_manifest(out.root, context_len=config.context_len, has_tokens=True,
                                  created_by="flashcp pack", tokenizer=spec.identity(),
                                  options={**identity["options"], "identity_sha256": identity_sha256},
                                  inputs=manifest_inputs, files=files, counts=counts)
        out.complete()
    except FlashcpError as e:
        if isinstance(e, InputChanged):  # no resume point may hold what was read from it
            out.forget_parts_from(next(i for i, f in enumerate(inputs) if f.path == e.path))
        out.discard()
        raise
    except OSError as e:
        out.discard()
        raise FlashcpError(f"cannot write the dataset to {config.output}: {e.strerror or e}") from None
    except BaseException:
        if out.target is not None:  # interrupted: a re-run of the command resumes the replacement
            out.release()
        raise
    if counts["records_skipped_total"]:
        reasons = ", ".join(f"{n} {reason.replace('_', ' ')}"
                            for reason, n in counts["records_skipped"].items() if n)
        warnings.append(f"skipped {counts['records_skipped_total']} bad records ({reasons}); --strict makes "
                        "them fatal")
    return PackResult(manifest=manifest, resumed_parts=resumed_parts, already_done=False,
                      seconds=time.perf_counter() - started, warnings=tuple(warnings),
                      resumed_tokens=resumed_tokens, notes=notes)
