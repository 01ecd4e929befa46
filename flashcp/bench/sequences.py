"""Where the bench's packed sequences come from: a named length distribution, a JSON length list, or DATA.

A source yields document-length arrays, one per packed sequence (shape (num_docs,), int64, summing to the
context length). Distributions are packed the way ``flashcp synth`` packs them
(``flashcp.data.synth.pack_lengths``), so the bench plans exactly what a synthetic dataset would hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashcp.errors import FlashcpError

__all__ = ["DATASET_LENGTH_ROWS", "SequenceSource", "open_source"]

DATASET_LENGTH_ROWS = 4096
"""Rows of a dataset whose document lengths feed re-packing at another context length."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSource:
    """A distribution or a dataset to draw packed sequences from."""

    label: str
    """Short name for tables (``wlb``, ``pile``, the dataset folder's name...)."""
    spec: str
    """What the user gave: a distribution name, a JSON path or a dataset folder."""
    dataset_context_len: int | None = None
    """The dataset's context length (sequences come at that length only); None for distributions."""

    @property
    def is_dataset(self) -> bool:
        """True for a dataset folder (fixed context length, sequences read in file order)."""
        return self.dataset_context_len is not None

    def sequences(self, num_seqs: int, context_len: int, seed: int = 0) -> list[np.ndarray]:
        """``num_seqs`` packed sequences of ``context_len`` tokens; same ``seed``, same sequences.

        A dataset at its own context length gives its first rows (at most what it holds); at another length
        its document lengths (of up to ``DATASET_LENGTH_ROWS`` rows) are drawn from and packed like a
        distribution's.
        """
        from flashcp.data.synth import Distribution, load_distribution, pack_lengths

        if self.is_dataset:
            if context_len == self.dataset_context_len:
                return _dataset_sequences(self.spec, num_seqs)
            # another length: re-pack the dataset's document lengths (already cut at its own length)
            lengths = np.concatenate(_dataset_sequences(self.spec, DATASET_LENGTH_ROWS))
            distribution = Distribution(name=self.label, lengths=lengths, source={"path": self.spec})
        else:
            distribution = load_distribution(self.spec)
        rng = np.random.default_rng(seed)
        offsets, doc_lens, *_ = pack_lengths(distribution, rng, num_seqs, context_len)
        return [doc_lens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(num_seqs)]


def _dataset_sequences(root: str, num_seqs: int) -> list[np.ndarray]:
    from flashcp.data.dataset import Dataset

    dataset = Dataset(root)
    out: list[np.ndarray] = []
    for index in range(len(dataset.files)):
        for offsets, lens in dataset.iter_doc_lens(index):
            for i in range(offsets.size - 1):
                if len(out) == num_seqs:
                    return out
                out.append(lens[offsets[i]:offsets[i + 1]].astype(np.int64))
    return out


def open_source(spec: str) -> SequenceSource:
    """A source for ``wlb``, ``prolong``, ``pile``, a JSON file of lengths, or a dataset folder.

    Raises FlashcpError with one sentence when ``spec`` is none of these.
    """
    path = Path(spec)
    if path.is_dir():
        from flashcp.data.dataset import Dataset

        dataset = Dataset(path)
        if dataset.num_sequences == 0:
            raise FlashcpError(f"dataset {spec} holds no sequences")
        return SequenceSource(label=path.resolve().name, spec=str(path),
                              dataset_context_len=dataset.context_len)
    from flashcp.data.synth import load_distribution

    distribution = load_distribution(spec)  # one-sentence FlashcpError for anything else
    label = spec if spec in ("wlb", "prolong", "pile") else Path(distribution.name).stem
    return SequenceSource(label=label, spec=spec)
