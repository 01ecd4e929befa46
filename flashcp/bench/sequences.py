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

__all__ = ["SequenceSource", "open_source"]


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
        """``num_seqs`` packed sequences of ``context_len`` tokens (a dataset gives at most what it holds).

        For a dataset ``context_len`` must equal its own. Same ``seed``, same sequences.
        """
        if self.is_dataset:
            if context_len != self.dataset_context_len:
                raise FlashcpError(f"dataset {self.spec} holds sequences of {self.dataset_context_len} "
                                   f"tokens, not {context_len}")
            return _dataset_sequences(self.spec, num_seqs)
        from flashcp.data.synth import load_distribution, pack_lengths

        rng = np.random.default_rng(seed)
        offsets, doc_lens, *_ = pack_lengths(load_distribution(self.spec), rng, num_seqs, context_len)
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
