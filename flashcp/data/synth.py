"""Synthetic datasets: document lengths drawn from a distribution, packed the paper's way, written out.

Distributions (``--dist``):

- ``wlb``: the WLB-LLM production length list shipped as ``flashcp/data/dists/wlb.json`` (99,519 lengths),
  sampled uniformly with replacement.
- ``prolong``: the ProLong length list ``flashcp/data/dists/prolong.json`` (77,932 lengths), likewise.
- ``pile``: a mixture over the 22 Pile subsets built from the Pile paper's Table 1 (Gao et al. 2020,
  arXiv:2101.00027): each subset's share of the training bytes (the "Weight" column, which includes the
  per-subset epochs) and its mean document size in KiB. Assumed, not published: (a) 0.34 tokens per byte,
  the ratio of the ~300B GPT-NeoX tokens of one Pile epoch (Pythia, Biderman et al. 2023) to its 825 GiB;
  (b) within a subset, lengths are lognormal with sigma 1.0 around the published mean. A document is drawn
  from subset ``s`` with probability proportional to ``weight_s / mean_size_s`` so that subsets keep their
  byte (token) shares.
- a path to a JSON file holding a list of positive document lengths, sampled like ``wlb``.

Packing (paper section 4.1): documents are taken in draw order and appended to the current window of
``context_len`` tokens; the document that overflows the window is truncated to fit (its remainder is
dropped) and the next document starts a new window. Every piece therefore starts at offset 0 of its input
document.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from flashcp._numba import njit
from flashcp.data.dataset import DataFile, data_table, write_data_file, write_manifest
from flashcp.errors import FlashcpError
from flashcp.fileio import sha256_file
from flashcp.outputs import MARKER_NAME, enclosing_dataset, is_marked, make_marked_dir

__all__ = [
    "NAMED_DISTRIBUTIONS",
    "PILE_SUBSETS",
    "Distribution",
    "check_synth_args",
    "doc_length_sampler",
    "load_distribution",
    "pack_lengths",
    "synth_dataset",
]

NAMED_DISTRIBUTIONS = ("wlb", "prolong", "pile")

MAX_DOC_LEN = 1 << 62
"""Longest document length a distribution file may list (packing cuts every document to the context length;
this keeps the draws' sums inside int64)."""

PILE_TOKENS_PER_BYTE = 0.34
PILE_LOGNORMAL_SIGMA = 1.0

# The Pile paper, Table 1: (subset, weight in % of training bytes, mean document size in KiB).
PILE_SUBSETS: tuple[tuple[str, float, float], ...] = (
    ("Pile-CC", 18.11, 4.33),
    ("PubMed Central", 14.40, 30.55),
    ("Books3", 12.07, 538.36),
    ("OpenWebText2", 10.01, 3.85),
    ("ArXiv", 8.96, 46.61),
    ("Github", 7.59, 5.25),
    ("FreeLaw", 6.12, 15.06),
    ("Stack Exchange", 5.13, 2.16),
    ("USPTO Backgrounds", 3.65, 4.08),
    ("PubMed Abstracts", 3.07, 1.30),
    ("Gutenberg (PG-19)", 2.17, 398.73),
    ("OpenSubtitles", 1.55, 30.48),
    ("Wikipedia (en)", 1.53, 1.11),
    ("DM Mathematics", 1.24, 8.00),
    ("Ubuntu IRC", 0.88, 545.48),
    ("BookCorpus2", 0.75, 369.87),
    ("EuroParl", 0.73, 68.87),
    ("HackerNews", 0.62, 4.92),
    ("YoutubeSubtitles", 0.60, 22.55),
    ("PhilPapers", 0.38, 73.37),
    ("NIH ExPorter", 0.30, 2.11),
    ("Enron Emails", 0.14, 1.78),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """A document-length distribution that can draw lengths reproducibly."""

    name: str
    """``wlb``, ``prolong``, ``pile`` or the JSON file's path."""
    lengths: np.ndarray | None
    """Empirical lengths sampled with replacement, shape (num_lengths,) int64; None for the Pile mixture."""
    source: dict
    """What the distribution was read from (the manifest's ``inputs`` entry) or the mixture's description."""

    def mean_length(self) -> float:
        """Mean document length in tokens (before packing)."""
        if self.lengths is not None:
            return float(self.lengths.mean())
        probs, means = _pile_mixture()
        return float((probs * means).sum())

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """Draw ``count`` document lengths (int64, all >= 1)."""
        if self.lengths is not None:
            return self.lengths[rng.integers(0, self.lengths.size, size=count)]
        probs, means = _pile_mixture()
        subset = rng.choice(probs.size, size=count, p=probs)
        mu = np.log(means[subset]) - PILE_LOGNORMAL_SIGMA ** 2 / 2
        return np.maximum(1, np.rint(rng.lognormal(mu, PILE_LOGNORMAL_SIGMA))).astype(np.int64)


def _pile_mixture() -> tuple[np.ndarray, np.ndarray]:
    weights = np.array([w for _, w, _ in PILE_SUBSETS])
    mean_tokens = np.array([kib for _, _, kib in PILE_SUBSETS]) * 1024 * PILE_TOKENS_PER_BYTE
    doc_share = weights / mean_tokens
    return doc_share / doc_share.sum(), mean_tokens


def doc_length_sampler(dist: str, rng: np.random.Generator) -> Callable[[int], np.ndarray]:
    """``sample(n) -> n document lengths`` drawn from the named distribution with ``rng``."""
    distribution = load_distribution(dist)
    return lambda n: distribution.draw(rng, n)


def _read_lengths(path: Path, label: str) -> np.ndarray:
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashcpError(f"distribution file {label} is not readable JSON ({e})") from None
    if not isinstance(values, list) or not values or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise FlashcpError(f"distribution file {label} must hold a non-empty JSON list of positive integer "
                           "document lengths")
    too_long = next((v for v in values if v > MAX_DOC_LEN), None)
    if too_long is not None:
        raise FlashcpError(f"distribution file {label} holds the document length {too_long}, above the "
                           f"largest supported {MAX_DOC_LEN:,} (2^62)")
    return np.asarray(values, dtype=np.int64)


def load_distribution(spec: str) -> Distribution:
    """Open ``wlb``, ``prolong``, ``pile`` or a JSON file of lengths; one-sentence FlashcpError otherwise."""
    if spec == "pile":
        source = {"path": "pile-mixture", "description": "The Pile paper Table 1 mixture",
                  "tokens_per_byte": PILE_TOKENS_PER_BYTE, "lognormal_sigma": PILE_LOGNORMAL_SIGMA,
                  "subsets": [list(s) for s in PILE_SUBSETS]}
        return Distribution(name="pile", lengths=None, source=source)
    if spec in ("wlb", "prolong"):
        resource = resources.files("flashcp.data") / "dists" / f"{spec}.json"
        with resources.as_file(resource) as path:
            lengths = _read_lengths(path, f"flashcp/data/dists/{spec}.json")
            source = {"path": f"flashcp/data/dists/{spec}.json", "bytes": path.stat().st_size,
                      "sha256": sha256_file(path)}
        return Distribution(name=spec, lengths=lengths, source=source)
    path = Path(spec)
    if path.suffix.lower() != ".json" or not path.is_file():
        raise FlashcpError(f"unknown distribution '{spec}': use wlb, prolong, pile or the path of a JSON "
                           "file listing document lengths")
    lengths = _read_lengths(path, str(path))
    return Distribution(name=str(path), lengths=lengths,
                        source={"path": str(path), "bytes": path.stat().st_size, "sha256": sha256_file(path)})


@njit(cache=True)
def _pack(lengths, context_len, max_rows, out_row_offsets, out_doc_lens, out_doc_index):
    """Pack ``lengths`` in order into windows; stop after ``max_rows`` full windows or when lengths run out.

    Returns (rows, docs written, lengths consumed, windows with a truncated last document).
    """
    rows = 0
    written = 0
    i = 0
    truncated = 0
    row_start_written = 0
    fill = 0
    while rows < max_rows and i < lengths.shape[0]:
        take = min(lengths[i], context_len - fill)
        out_doc_lens[written] = take
        out_doc_index[written] = i
        written += 1
        fill += take
        if take < lengths[i]:
            truncated += 1
        i += 1
        if fill == context_len:
            rows += 1
            out_row_offsets[rows] = written
            row_start_written = written
            fill = 0
    # an unfinished window is handed back: its lengths are consumed again by the next call
    if fill > 0:
        i -= written - row_start_written
        written = row_start_written
    return rows, written, i, truncated


def pack_lengths(dist: Distribution, rng: np.random.Generator, num_seqs: int,
                 context_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Draw documents and pack ``num_seqs`` windows of ``context_len`` tokens.

    Returns ``(row_offsets (num_seqs + 1,), doc_lens, doc_source, docs_read, docs_truncated)``;
    ``doc_source[j]`` is the draw index of piece ``j``'s input document.
    """
    offsets_parts, lens_parts, source_parts = [np.zeros(1, np.int64)], [], []
    done, base_docs, base_draws, truncated = 0, 0, 0, 0
    carry = np.zeros(0, np.int64)
    mean = dist.mean_length()
    while done < num_seqs:
        want = num_seqs - done
        draw_count = int(want * context_len / max(1.0, min(mean, context_len)) * 1.05) + 64
        lengths = np.concatenate([carry, dist.draw(rng, draw_count)])
        # each window uses at most context_len documents, and no more than the lengths on hand
        cap = min(lengths.size, want * context_len)
        row_offsets = np.zeros(want + 1, np.int64)
        doc_lens = np.empty(cap, np.int64)
        doc_index = np.empty(cap, np.int64)
        rows, written, consumed, cut = _pack(lengths, context_len, want, row_offsets, doc_lens, doc_index)
        offsets_parts.append(row_offsets[1:rows + 1] + base_docs)
        lens_parts.append(doc_lens[:written])
        source_parts.append(doc_index[:written] + base_draws)
        carry = lengths[consumed:]
        base_docs += written
        base_draws += consumed
        truncated += cut
        done += rows
    return (np.concatenate(offsets_parts), np.concatenate(lens_parts), np.concatenate(source_parts),
            base_draws, truncated)


def _file_layout(context_len: int, has_tokens: bool) -> tuple[int, int]:
    """(rows per data file, rows per row group): about 256 MiB files and 32 MiB row groups of token ids."""
    if not has_tokens:
        return 8192, 1024
    return min(8192, max(1, 2 ** 26 // context_len)), min(1024, max(1, 2 ** 23 // context_len))


def check_synth_args(root: Path, *, num_seqs: int, context_len: int, vocab_size: int,
                     rows_per_file: int | None) -> None:
    """FlashcpError (one sentence) for arguments ``synth_dataset`` refuses; checked before any work."""
    if num_seqs < 1:
        raise FlashcpError(f"--num-seqs must be at least 1, got {num_seqs}")
    from flashcp.costmodel.limits import check_context_len

    if context_len < 1:
        raise FlashcpError(f"--context-len must be at least 1, got {context_len}")
    try:
        check_context_len(context_len)
    except ValueError as e:
        raise FlashcpError(str(e)) from None
    if rows_per_file is not None and rows_per_file < 1:
        raise FlashcpError(f"--rows-per-file must be at least 1, got {rows_per_file}")
    if vocab_size < 1 or vocab_size > 2 ** 31 - 1:
        raise FlashcpError(f"--vocab-size must be in [1, 2^31), got {vocab_size}")
    if root.is_symlink() or (root.exists() and (not root.is_dir() or any(root.iterdir()))):
        raise FlashcpError(f"{root} already exists and is not an empty folder; choose a new path")
    inside = enclosing_dataset(root.parent)
    if inside is not None:
        raise FlashcpError(f"{root} lies inside the dataset {inside}; choose a path outside it")


def synth_dataset(root: str | Path, *, dist: str, num_seqs: int, context_len: int, seed: int = 0,
                  with_tokens: bool = True, vocab_size: int = 32000,
                  rows_per_file: int | None = None) -> dict:
    """Write a synthetic dataset at ``root`` and return its manifest.

    Token ids are uniform in ``[0, vocab_size)``; lengths do not depend on ``with_tokens``, so a
    lengths-only dataset has the same documents as the full one with the same seed. Refuses a ``root`` that
    already holds a dataset or other files. The dataset is written in a hidden folder beside ``root`` and
    renamed into place once complete, so an interrupted run leaves nothing behind. ``rows_per_file``
    defaults to about 256 MiB of token ids per file (8192 rows without tokens).
    """
    root = Path(root)
    check_synth_args(root, num_seqs=num_seqs, context_len=context_len, vocab_size=vocab_size,
                     rows_per_file=rows_per_file)
    distribution = load_distribution(dist)
    seeds = np.random.SeedSequence(seed).spawn(2)
    row_offsets, doc_lens, doc_source, docs_read, truncated = pack_lengths(
        distribution, np.random.default_rng(seeds[0]), num_seqs, context_len)
    token_rng = np.random.default_rng(seeds[1])

    root.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_staging(root)
    staging = root.parent / f".{root.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    make_marked_dir(staging, f"staging folder of synth dataset {root.name}")  # mkdir honours the umask
    try:
        manifest = _write_files(staging, distribution, row_offsets, doc_lens, doc_source, token_rng,
                                context_len=context_len, with_tokens=with_tokens, vocab_size=vocab_size,
                                seed=seed, docs_read=docs_read, truncated=truncated,
                                rows_per_file=rows_per_file)
        (staging / MARKER_NAME).unlink()  # a dataset from here on, no longer a staging folder
        if root.exists():
            root.rmdir()  # empty, checked above
        os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # made by this very run
        raise
    return manifest


def _remove_dead_staging(root: Path) -> None:
    """Remove the staging folders of killed runs for ``root`` (the pid in their name is gone).

    Only folders holding flashcp's marker (or empty ones) are removed; one of that name without it is left alone.
    """
    pattern = re.compile(rf"\.{re.escape(root.name)}\.(\d+)-[0-9a-f]{{8}}\.tmp")
    for entry in root.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir() or _alive(int(match.group(1))):
            continue
        if is_marked(entry):
            shutil.rmtree(entry)
        elif not any(entry.iterdir()):
            entry.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _write_files(root: Path, distribution: Distribution, row_offsets, doc_lens, doc_source, token_rng, *,
                 context_len: int, with_tokens: bool, vocab_size: int, seed: int, docs_read: int,
                 truncated: int, rows_per_file: int | None) -> dict:
    num_seqs = row_offsets.size - 1
    default_rows, rows_per_group = _file_layout(context_len, with_tokens)
    rows_per_file = rows_per_file or default_rows
    files: list[DataFile] = []
    for index, lo in enumerate(range(0, num_seqs, rows_per_file)):
        hi = min(num_seqs, lo + rows_per_file)
        d0, d1 = row_offsets[lo], row_offsets[hi]
        tokens = None
        if with_tokens:
            tokens = token_rng.integers(0, vocab_size, size=(hi - lo) * context_len, dtype=np.int32)
        table = data_table(row_offsets[lo:hi + 1] - d0, doc_lens[d0:d1], doc_source[d0:d1],
                           np.zeros(d1 - d0, np.int64), tokens, context_len)
        files.append(write_data_file(root, index, table, rows_per_group))

    options = {"dist": distribution.name, "num_seqs": num_seqs, "seed": seed, "with_tokens": with_tokens,
               "vocab_size": vocab_size if with_tokens else None, "overflow": "truncate"}
    tokenizer = {"name": "synthetic-uniform" if with_tokens else "none", "sha256": None,
                 "vocab_size": vocab_size if with_tokens else None}
    counts = {"documents_read": int(docs_read), "documents_dropped": 0, "documents_split": 0,
              "documents_truncated": int(truncated), "pieces": int(doc_lens.size),
              "tokens": int(num_seqs) * int(context_len)}
    return write_manifest(root, context_len=context_len, has_tokens=with_tokens, created_by="flashcp synth",
                          tokenizer=tokenizer, options=options, inputs=[distribution.source], files=files,
                          counts=counts)
