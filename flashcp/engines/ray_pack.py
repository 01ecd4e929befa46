"""``flashcp pack --engine ray``: the local pack's steps spread over a Ray cluster, with the same bytes.

The run has three kinds of work, and only the second runs on the driver:

1. *Tokenize* (Ray tasks, one per input shard: 16 MiB of a JSONL file cut at line starts, a few row groups of
   a Parquet file, or a whole ``.jsonl.gz`` or text file). A task reads its records with flashcp's own readers,
   tokenizes them with the process's one Encoder (loaded once per worker process) and returns two objects:
   small *meta* (every record's kind and position, every document's length) and the *tokens*, which stay in
   the object store.
2. *Lay out* (the driver, lengths only). Shards are taken in input order. The driver counts records exactly
   as the local pack does and feeds every document's length to the packer's loop on lengths alone (the Numba
   ``flashcp.engines._layout``, a twin of ``Packer(lengths_only=True)``): the prefix sum of lengths fixes
   where every sequence, row group and data file starts, and the counters at every data file boundary (the
   resume point the local pack records). It never touches a token.
3. *Write* (Ray tasks, one per data file). A task gets the documents of its file (their shard, offset and
   length) and the start state, runs the real ``Packer`` from that state over those tokens, and writes the
   file with the local ``DataFileWriter`` in the same row groups. The output folder must be on a filesystem
   every node sees.

The driver records every finished data file, in order, in ``pack-state.json`` exactly as the local pack does,
so a killed driver re-run with the same command resumes after the last recorded file (with either engine),
and ``flashcp.data.pack`` writes the manifest. Tasks are deterministic and Ray re-runs a task whose worker
died (and a tokenize task whose output was lost with its node), so a lost worker changes nothing.
"""

from __future__ import annotations

import copy
import os
import socket
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from flashcp.data.dataset import DATA_DIR, DataFile, DataFileWriter, data_table
from flashcp.data.pack import BATCH_CHARS, PackConfig, PackRun, check_inputs_unchanged
from flashcp.data.pack_output import OutputFolder, PartRecord
from flashcp.data.packing import PackCounts, Packer
from flashcp.data.readers import (
    DOC,
    SKIP_REASONS,
    InputFile,
    bad_record_error,
    check_stamp,
    hash_input,
    parse_jsonl_line,
    read_records,
    recheck_input,
)
from flashcp.data.tokenizer import Encoder, resolve_tokenizer
from flashcp.engines._layout import lay_out
from flashcp.engines.ray_cluster import cluster_cpus, get_result, require_ray
from flashcp.errors import FlashcpError

__all__ = ["SHARD_BYTES", "RayPackEngine", "Shard"]

SHARD_BYTES = 1 << 24
"""Input bytes per tokenize task at most (about 4M tokens of English text)."""
MIN_SHARD_BYTES = 1 << 20
"""Input bytes per tokenize task at least, when the inputs are too small to give every CPU a few tasks."""
TASKS_PER_CPU = 3
"""Tokenize tasks queued per cluster CPU: enough to keep every CPU busy while the driver lays out."""
WRITERS_PER_CPU = 1
"""Write tasks queued per cluster CPU; bounds the tokens pinned in the object store."""


@dataclass(frozen=True, slots=True)
class Shard:
    """One tokenize task's part of an input file."""

    input: int
    """Index of the input file."""
    kind: str
    """``bytes``: JSONL lines starting in ``[start, stop)``; ``rows``: Parquet rows ``[start, stop)``;
    ``whole``: the whole file (``.jsonl.gz``, text, or a Parquet file whose footer cannot be read)."""
    start: int
    stop: int


# ---- what runs in Ray worker processes ----

_encoders: dict[tuple[str, bool], Encoder] = {}  # one per worker process, built on its first task


def _encoder(name: str, identity: dict, append_eos: bool) -> Encoder:
    key = (name, append_eos)
    if key not in _encoders:
        spec = resolve_tokenizer(name)
        if spec.identity() != identity:
            raise FlashcpError(f"tokenizer {name} on Ray node {socket.gethostname()} differs from the driver's "
                               f"(sha256 {spec.sha256[:12]} there, {identity['sha256'][:12]} on the driver); "
                               "install the same tokenizer on every node")
        _encoders[key] = Encoder(spec, append_eos=append_eos)
    return _encoders[key]


def _describe_input(input_file: InputFile, shard_bytes: int) -> tuple[InputFile, list[tuple[str, int, int]]]:
    """The input hashed (``hash_input``: sha256, size, stamp) and how it is cut into shards."""
    entry = input_file = hash_input(input_file)
    if input_file.format == "jsonl":
        return entry, [("bytes", lo, min(lo + shard_bytes, input_file.bytes))
                       for lo in range(0, input_file.bytes, shard_bytes)]
    if input_file.format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            metadata = pq.ParquetFile(input_file.path).metadata
        except (OSError, pa.ArrowException):
            return entry, [("whole", 0, 0)]  # the tokenize task reports the error in input order
        shards, first, row, size = [], 0, 0, 0
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            row, size = row + group.num_rows, size + group.total_byte_size
            if size >= shard_bytes:
                shards.append(("rows", first, row))
                first, size = row, 0
        if row > first:
            shards.append(("rows", first, row))
        return entry, shards
    return entry, [("whole", 0, 0)]


def _jsonl_range(input_file: InputFile, field: str, lo: int, hi: int,
                 counted: list[int]) -> Iterator[tuple[int, int, str | None]]:
    """``(line, kind, text)`` of the non-blank lines starting in bytes ``[lo, hi)``.

    ``line`` counts from the first line of the range; ``counted[0]`` ends as the number of lines in it.
    """
    try:
        with open(input_file.path, "rb") as f:
            check_stamp(input_file, os.fstat(f.fileno()))
            if lo > 0:
                f.seek(lo - 1)
                if f.read(1) != b"\n":
                    f.readline()  # the line under way belongs to the shard before
            line_no = 0
            while f.tell() < hi:
                line = f.readline()
                if not line:
                    break
                line_no += 1
                counted[0] = line_no
                if line.strip():
                    yield line_no - 1, *parse_jsonl_line(line, field)
            check_stamp(input_file, os.fstat(f.fileno()))  # unchanged while the range was read
    except OSError as e:
        raise FlashcpError(f"cannot read input {input_file.path}: {e.strerror or e}") from None


def _tokenize_shard(input_file: InputFile, kind: str, start: int, stop: int, skip_before: int, text_field: str,
                    tokenizer: str, identity: dict, append_eos: bool) -> tuple[dict, np.ndarray]:
    """Read and tokenize one shard: ``(meta, tokens)``; a read error ends the shard and is kept in meta.

    ``input_file`` carries its stamp, which the readers check; its content is re-hashed by the driver's
    ``_recheck_input`` tasks once every shard of it is read.
    """
    encoder = _encoder(tokenizer, identity, append_eos)
    kinds: list[int] = []
    records: list[int] = []
    token_parts: list[np.ndarray] = []
    len_parts: list[np.ndarray] = []
    texts: list[str] = []
    chars = 0
    counted = [0]
    error = None

    def flush() -> None:
        nonlocal texts, chars
        if texts:
            tokens, lens = encoder.encode(texts)
            token_parts.append(tokens)
            len_parts.append(lens)
            texts, chars = [], 0

    if kind == "bytes":
        stream: Iterator = _jsonl_range(input_file, text_field, start, stop, counted)
    else:
        reader = read_records(input_file, text_field=text_field, start=max(start, skip_before))
        stream = ((record, record_kind, text) for _, record, record_kind, text in reader)
    try:
        for record, record_kind, text in stream:
            if kind == "rows" and record >= stop:
                break
            kinds.append(record_kind)
            records.append(record)
            if record_kind == DOC:
                texts.append(text)
                chars += len(text)
                if chars >= BATCH_CHARS:
                    flush()
    except FlashcpError as e:
        error = e  # raised by the driver in input order (an InputChanged stays one)
    flush()
    meta = {"kinds": np.array(kinds, np.int8), "records": np.array(records, np.int64),
            "lens": np.concatenate(len_parts) if len_parts else np.zeros(0, np.int64),
            "lines": counted[0], "error": error, "node": _node_id()}
    return meta, (np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32))


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _write_part(root: str, index: int, context_len: int, overflow: str, counts: dict, rows: int,
                row_group_rows: int, docs: np.ndarray, *token_arrays: np.ndarray) -> tuple[DataFile, dict]:
    """Write the ``index``-th data file: its first ``rows`` sequences, packed from the packer state ``counts``.

    ``docs`` rows are ``(array, offset, length, doc_index, start)``: a document's tokens in ``token_arrays``.
    """
    packer = Packer(context_len, overflow, PackCounts(**counts))
    writer = DataFileWriter(Path(root), index)
    group: list = []
    written, last_counts = 0, counts
    try:
        for array, offset, length, doc_index, start in docs.tolist():
            for window in packer.add(doc_index, token_arrays[array][offset:offset + length], start):
                group.append(window)
                last_counts = window.counts.to_json()
                if len(group) == row_group_rows or written + len(group) == rows:
                    _write_group(writer, group, context_len)
                    written += len(group)
                    group = []
                if written == rows:
                    return writer.close(), last_counts
        raise AssertionError(f"data file {index}: the documents filled {written} of {rows} sequences")
    except BaseException:
        writer.abort()
        raise


def _write_group(writer: DataFileWriter, windows: list, context_len: int) -> None:
    """One row group, built as ``flashcp.data.pack`` builds it."""
    offsets = np.zeros(len(windows) + 1, np.int64)
    np.cumsum([w.doc_lens.size for w in windows], out=offsets[1:])
    writer.write(data_table(offsets, np.concatenate([w.doc_lens for w in windows]),
                            np.concatenate([w.doc_source for w in windows]),
                            np.concatenate([w.doc_offset for w in windows]),
                            np.concatenate([w.tokens for w in windows]), context_len))


def _remote(ray, function: Callable, **options):
    return ray.remote(**options)(function)


# ---- the driver ----

class RayPackEngine:
    """The ``engine`` of ``flashcp.data.pack.run_pack`` for ``--engine ray``; use inside ``ray_session``."""

    def __init__(self, workers: int | None = None, shard_bytes: int | None = None):
        self.ray = require_ray()
        cpus = cluster_cpus(self.ray)
        self.cpus = min(cpus, workers) if workers else cpus
        self.shard_bytes = shard_bytes
        self.nodes_used: set[str] = set()
        """Ray nodes that ran tokenize tasks."""
        self.shards: list[Shard] = []
        # spread over the nodes (independent, CPU-bound); write tasks go where most of their tokens are
        self.tokenize = _remote(self.ray, _tokenize_shard, num_returns=2, num_cpus=1, scheduling_strategy="SPREAD")
        self.write = _remote(self.ray, _write_part, num_cpus=1)
        self.describe = _remote(self.ray, _describe_input, num_cpus=1)
        self.recheck = _remote(self.ray, recheck_input, num_cpus=1)

    def hash_inputs(self, inputs: list[InputFile]) -> list[InputFile]:
        """Hash the inputs and cut them into shards, one Ray task per input."""
        shard_bytes = self.shard_bytes  # small inputs: smaller shards, so that every CPU gets a few
        if shard_bytes is None:
            per_task = sum(i.bytes for i in inputs) // (TASKS_PER_CPU * self.cpus)
            shard_bytes = min(SHARD_BYTES, max(MIN_SHARD_BYTES, per_task))
        refs = [self.describe.remote(input_file, shard_bytes) for input_file in inputs]
        hashed, self.shards = [], []
        for index, ref in enumerate(refs):
            input_file, shards = get_result(self.ray, ref)
            hashed.append(input_file)
            self.shards += [Shard(index, kind, lo, hi) for kind, lo, hi in shards]
        return hashed

    def pack_run(self, config: PackConfig, encoder: Encoder, pool: None, inputs: list[InputFile],
                 out: OutputFolder, identity: dict, identity_sha256: str,
                 on_rows: Callable[[int], None]) -> _RayPackRun:
        """The pass over the inputs that ``run_pack`` runs."""
        return _RayPackRun(self, config, encoder, inputs, out, identity, identity_sha256, on_rows)


@dataclass(slots=True)
class _Part:
    """A data file being laid out: its documents and the token arrays they are in."""

    counts: dict
    chunks: list[np.ndarray] = field(default_factory=list)
    refs: list = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)

    def add(self, shard_id: int, ref, docs: np.ndarray) -> None:
        """Append documents of one shard (rows ``(_, offset, length, doc_index, start)``)."""
        if not docs.size:
            return
        slot = self.slots.get(shard_id)
        if slot is None:
            slot = self.slots[shard_id] = len(self.refs)
            self.refs.append(ref)
        docs[:, 0] = slot
        self.chunks.append(docs)


class _RayPackRun(PackRun):
    """``PackRun`` with its pass over the inputs done by Ray tasks (module docstring)."""

    def __init__(self, engine: RayPackEngine, config: PackConfig, encoder: Encoder, inputs: list[InputFile],
                 out: OutputFolder, identity: dict, identity_sha256: str, on_rows: Callable[[int], None]):
        super().__init__(config, encoder, None, inputs, out, identity, identity_sha256, on_rows)
        self.engine, self.ray = engine, engine.ray
        # final_counts reads its counts and tail; the layout kernel hands it its state at the end
        self.packer = Packer(config.context_len, config.overflow, PackCounts(**self.snapshot["packer"]),
                             lengths_only=True)
        self.tokenizer_name = config.tokenizer
        if os.path.exists(self.tokenizer_name):
            self.tokenizer_name = str(Path(self.tokenizer_name).resolve())
        self.tokenize_queue: deque = deque()
        self.write_queue: deque = deque()

    def run(self) -> None:
        """Lay out every document from the resume point on; write tasks write the data files."""
        try:
            self._run()
        except BaseException:
            self._cancel()
            raise

    def _run(self) -> None:
        config, ray, counts = self.config, self.ray, self.snapshot
        eos = 1 if self.encoder.eos_id is not None else 0
        doc_index, first_offset = self.resume["next_doc"], self.resume["offset"]
        first_input, first_record = self.resume["input"], self.resume["record"]
        shards = iter([s for s in enumerate(self.engine.shards) if s[1].input > first_input
                       or (s[1].input == first_input and not (s[1].kind == "rows" and s[1].stop <= first_record))])
        packer = self.snapshot["packer"]
        state = np.array([0, 0, packer["documents_split"], packer["documents_truncated"],
                          packer["tokens_truncated"]], np.int64)
        part = _Part(counts=dict(packer))
        rows_in_part, line_base, base_input = 0, 0, -1
        self._submit(shards, first_input, first_record)
        while self.tokenize_queue:
            shard_id, shard, meta_ref, tokens_ref = self.tokenize_queue.popleft()
            self._submit(shards, first_input, first_record)
            meta = get_result(ray, meta_ref)
            self.engine.nodes_used.add(meta["node"])
            if shard.input != base_input:
                base_input, line_base = shard.input, 0
            records = meta["records"] + (line_base if shard.kind == "bytes" else 0)
            line_base += meta["lines"]
            kinds, lens = meta["kinds"], meta["lens"]
            is_doc = kinds == DOC
            keep = records >= first_record if shard.input == first_input else np.ones(kinds.size, bool)
            bad = keep & ~is_doc
            if config.strict and bad.any():
                at = int(np.argmax(bad))
                raise bad_record_error(int(kinds[at]), self.inputs[shard.input], int(records[at]), config.text_field)
            # the shard's documents (records before the resume point left out), in order
            token_offsets = np.zeros(lens.size, np.int64)
            np.cumsum(lens[:-1], out=token_offsets[1:])
            doc_keep = keep[is_doc]
            doc_lens, doc_offsets = lens[doc_keep], token_offsets[doc_keep]
            doc_records = np.flatnonzero(is_doc)[doc_keep]
            doc_starts = np.zeros(doc_lens.size, np.int64)
            if doc_lens.size and first_offset:
                doc_starts[0], first_offset = first_offset, 0  # a resumed document was counted by its run
            counted = doc_starts == 0
            empty = counted & (doc_lens == eos)
            read_cum, empty_cum = np.cumsum(counted), np.cumsum(empty)
            tokens_cum = np.cumsum(np.where(counted & ~empty, doc_lens, 0))
            packed = np.flatnonzero(~empty)
            windows = lay_out(doc_lens[packed], doc_starts[packed], config.context_len,
                              config.overflow == "truncate", state)
            base = (counts["documents_read"], counts["documents_empty"], counts["tokens_read"],
                    dict(counts["records_skipped"]), self.input_documents[shard.input])
            skipped_cum = {reason: np.cumsum(bad & (kinds == k + 1)) for k, reason in enumerate(SKIP_REASONS)}

            def advance(doc: int, record: int | None) -> None:
                """Set the counters to where they stand at document ``doc`` of the shard (or its end)."""
                counts["documents_read"] = base[0] + (int(read_cum[doc]) if doc >= 0 else 0)
                counts["documents_empty"] = base[1] + (int(empty_cum[doc]) if doc >= 0 else 0)
                counts["tokens_read"] = base[2] + (int(tokens_cum[doc]) if doc >= 0 else 0)
                for reason, cum in skipped_cum.items():
                    upto = cum.size if record is None else record
                    counts["records_skipped"][reason] = base[3][reason] + (int(cum[upto - 1]) if upto else 0)
                self.input_documents[shard.input] = base[4] + (int(read_cum[doc]) if doc >= 0 else 0)

            first, first_start = 0, -1  # the next piece of the part: packed[first], from first_start if >= 0
            for w in range(self.rows_per_file - rows_in_part - 1, len(windows), self.rows_per_file):
                j, resume_offset = int(windows[w, 0]), int(windows[w, 1])
                window_counts = {"documents_split": int(windows[w, 2]), "documents_truncated": int(windows[w, 3]),
                                 "tokens_truncated": int(windows[w, 4])}
                doc = int(packed[j])
                advance(doc, int(doc_records[doc]))
                part.add(shard_id, tokens_ref, self._docs(packed[first:j + 1], first_start, doc_offsets, doc_lens,
                                                          doc_index, doc_starts))
                self._finish_part(part, self.rows_per_file, window_counts, shard.input,
                                  int(records[doc_records[doc]]), doc_index + doc, resume_offset)
                part = _Part(counts=window_counts)
                first, first_start = (j, resume_offset) if resume_offset else (j + 1, -1)
            self.on_rows(len(windows))  # sequences laid out: they follow tokenization, which sets the pace
            rows_in_part = (rows_in_part + len(windows)) % self.rows_per_file
            if first < packed.size:
                part.add(shard_id, tokens_ref, self._docs(packed[first:], first_start, doc_offsets, doc_lens,
                                                          doc_index, doc_starts))
            advance(doc_lens.size - 1, None)
            doc_index += doc_lens.size
            if meta["error"] is not None:
                raise meta["error"]
        self.packer.resume(int(state[0]), int(state[1]), PackCounts(
            documents_split=int(state[2]), documents_truncated=int(state[3]), tokens_truncated=int(state[4])))
        self._recheck_inputs(first_input)
        if rows_in_part:
            ref = self._submit_write(part, rows_in_part)
            self._collect(block=True)
            self.last_file, _ = get_result(ray, ref)
            self._check_visible(self.last_file)
        self._collect(block=True)
        for path in (self.out.root / DATA_DIR).glob(".part-*.tmp"):
            path.unlink(missing_ok=True)  # left by a write task killed mid-file and run again

    @staticmethod
    def _docs(which: np.ndarray, first_start: int, offsets: np.ndarray, lens: np.ndarray, first_index: int,
              starts: np.ndarray) -> np.ndarray:
        """Rows ``(0, offset, length, doc_index, start)`` of the shard's documents ``which``."""
        docs = np.stack([np.zeros(which.size, np.int64), offsets[which], lens[which], first_index + which,
                         starts[which]], axis=1)
        if first_start >= 0 and which.size:
            docs[0, 4] = first_start
        return docs

    def _recheck_inputs(self, first_input: int) -> None:
        """After the last shard: every input read in byte ranges or row groups is still what was hashed.

        (A ``.jsonl.gz`` or text input is read whole by one task, which hashes it as it reads.)
        """
        refs = [self.engine.recheck.remote(input_file) for input_file in self.inputs[first_input:]
                if input_file.format in ("jsonl", "parquet")]
        for ref in refs:
            get_result(self.ray, ref)

    def _submit(self, shards: Iterator[tuple[int, Shard]], first_input: int, first_record: int) -> None:
        """Keep ``TASKS_PER_CPU`` tokenize tasks per CPU queued."""
        config = self.config
        identity = self.encoder.spec.identity()
        while len(self.tokenize_queue) < TASKS_PER_CPU * self.engine.cpus:
            item = next(shards, None)
            if item is None:
                return
            shard_id, shard = item
            skip = first_record if shard.input == first_input and shard.kind != "bytes" else 0
            input_file = self.inputs[shard.input]
            if shard.kind != "whole":  # read in parts: its stamp is checked, its content re-hashed at the end
                input_file = replace(input_file, sha256=None)
            meta_ref, tokens_ref = self.engine.tokenize.remote(
                input_file, shard.kind, shard.start, shard.stop, skip, config.text_field,
                self.tokenizer_name, identity, config.append_eos)
            self.tokenize_queue.append((shard_id, shard, meta_ref, tokens_ref))

    def _submit_write(self, part: _Part, rows: int):
        docs = np.concatenate(part.chunks) if part.chunks else np.zeros((0, 5), np.int64)
        index = len(self.out.parts) + len(self.write_queue)
        return self.engine.write.remote(str(self.out.root), index, self.config.context_len, self.config.overflow,
                                        part.counts, rows, self.row_group_rows, docs, *part.refs)

    def _finish_part(self, part: _Part, rows: int, window_counts: dict, input_index: int, record_index: int,
                     doc_index: int, resume_offset: int) -> None:
        """Submit the data file's write task with the resume point and counters ``PackRun`` would record."""
        if resume_offset:
            resume = {"input": input_index, "record": record_index, "offset": resume_offset,
                      "next_doc": doc_index}
        else:
            resume = {"input": input_index, "record": record_index + 1, "offset": 0, "next_doc": doc_index + 1}
        snapshot = copy.deepcopy(self.snapshot)
        snapshot["packer"] = window_counts
        first, docs = self.part_first_input, self.input_documents
        snapshot["input_documents_delta"] = {
            "first": first, "counts": [docs[first] - self.part_first_count, *docs[first + 1:input_index + 1]]}
        self.part_first_input, self.part_first_count = input_index, docs[input_index]
        while len(self.write_queue) >= WRITERS_PER_CPU * self.engine.cpus:
            self._collect(block=True, one=True)
        ref = self._submit_write(part, rows)
        self.write_queue.append((ref, resume, snapshot))
        self._collect(block=False)

    def _collect(self, *, block: bool, one: bool = False) -> None:
        """Record finished data files in order, as ``PackRun`` does after each."""
        while self.write_queue:
            ref, resume, snapshot = self.write_queue[0]
            if not block and not self.ray.wait([ref], timeout=0)[0]:
                return
            data_file, counts = get_result(self.ray, ref)
            if counts != snapshot["packer"]:
                raise AssertionError(f"data file {data_file.path}: the write task ended with packer counts "
                                     f"{counts}, the layout with {snapshot['packer']}")
            self._check_visible(data_file)
            check_inputs_unchanged(self.inputs, snapshot["input_documents_delta"]["first"], resume["input"])
            self.write_queue.popleft()
            self.out.parts.append(PartRecord(file=data_file, resume=resume, snapshot=snapshot))
            self.out.write_state(self.identity_sha256, self.identity)
            if one:
                return

    def _check_visible(self, data_file: DataFile) -> None:
        if not (self.out.root / data_file.path).is_file():
            raise FlashcpError(f"a Ray worker wrote {data_file.path} where the driver cannot see it; the output "
                               f"folder {self.out.root} must be on a filesystem every Ray node shares")

    def _cancel(self) -> None:
        """Stop queued tokenize tasks and wait for every write task, so that none writes after the run failed.

        Only tokenize tasks are cancelled: a write task whose input was cancelled fails without running. A
        write task is never cancelled itself: Ray 2.60 aborts the driver process ("Check failed:
        submitted_task_ref_count > 0" in its reference counter) when a task is cancelled while its arguments
        are still being resolved.
        """
        for item in self.tokenize_queue:
            self.ray.cancel(item[2])
        writes = [item[0] for item in self.write_queue]
        if writes:
            self.ray.wait(writes, num_returns=len(writes), timeout=60)
        self.tokenize_queue.clear()
        self.write_queue.clear()

