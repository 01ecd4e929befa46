"""The streaming packer: documents in input order fill sequences of exactly ``context_len`` tokens.

Each document (its ids, EOS included) is laid into the current sequence. When the sequence fills up in the
middle of a document, the rest of the document either continues at the start of the next sequence as a new
piece whose ``doc_offset`` is its offset inside the document (``overflow="split"``), or is dropped
(``overflow="truncate"``, the FlashCP paper's setting: "the last document is truncated to fit"). What is left
in the last, partial sequence when the input ends is the *tail*: it is never written, only counted.

The packer holds one sequence at a time, so memory does not grow with the input. ``tests/naive.py`` has a
token-at-a-time reference that the tests compare it with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["OVERFLOWS", "PackCounts", "Packer", "Window"]

OVERFLOWS = ("split", "truncate")


@dataclass(slots=True)
class PackCounts:
    """What the packer itself counts; restored from a snapshot when a run resumes."""

    documents_split: int = 0
    """Documents continued past the end of a sequence (``split``)."""
    documents_truncated: int = 0
    """Documents cut at the end of a sequence, their rest dropped (``truncate``)."""
    tokens_truncated: int = 0
    """Tokens dropped by truncation."""

    def to_json(self) -> dict:
        """The counts as a plain dict."""
        return {"documents_split": self.documents_split, "documents_truncated": self.documents_truncated,
                "tokens_truncated": self.tokens_truncated}


@dataclass(frozen=True, slots=True)
class Window:
    """One full packed sequence, and where packing stands right after it."""

    tokens: np.ndarray
    """(context_len,) int32 token ids."""
    doc_lens: np.ndarray
    """(pieces,) int32 piece lengths, summing to context_len, none 0."""
    doc_source: np.ndarray
    """(pieces,) int64 index of each piece's document in input order."""
    doc_offset: np.ndarray
    """(pieces,) int32 offset of each piece inside its document."""
    resume_offset: int
    """Offset inside the document being added at which the next sequence starts; 0 when it starts with the
    next document."""
    counts: PackCounts
    """The packer's counts right after this sequence was closed."""


class Packer:
    """Packs documents, fed one at a time with ``add``, into Windows of exactly ``context_len`` tokens."""

    def __init__(self, context_len: int, overflow: str = "split", counts: PackCounts | None = None):
        if context_len < 1:
            raise ValueError(f"context_len must be at least 1, got {context_len}")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
        self.context_len = context_len
        self.overflow = overflow
        self.counts = PackCounts(**counts.to_json()) if counts is not None else PackCounts()
        self._tokens = np.empty(context_len, np.int32)
        self._fill = 0
        self._sources: list[int] = []
        self._offsets: list[int] = []
        self._lens: list[int] = []

    def add(self, doc_index: int, tokens: np.ndarray, start: int = 0) -> list[Window]:
        """Lay ``tokens[start:]`` of document ``doc_index`` into the sequence; return the sequences it closed.

        ``tokens`` (n,) int32 is the whole document (EOS included); ``start`` > 0 resumes a document that an
        earlier run had already placed up to ``start``.
        """
        context_len, n = self.context_len, len(tokens)
        pos = start
        closed: list[Window] = []
        while pos < n:
            take = min(n - pos, context_len - self._fill)
            self._tokens[self._fill:self._fill + take] = tokens[pos:pos + take]
            self._sources.append(doc_index)
            self._offsets.append(pos)
            self._lens.append(take)
            self._fill += take
            piece_start, pos = pos, pos + take
            if self._fill < context_len:
                break
            if pos < n:
                if self.overflow == "truncate":
                    self.counts.documents_truncated += 1
                    self.counts.tokens_truncated += n - pos
                    pos = n
                elif piece_start == 0:
                    self.counts.documents_split += 1
            closed.append(self._close(pos if pos < n else 0))
        return closed

    def _close(self, resume_offset: int) -> Window:
        window = Window(tokens=self._tokens.copy(), doc_lens=np.array(self._lens, np.int32),
                        doc_source=np.array(self._sources, np.int64),
                        doc_offset=np.array(self._offsets, np.int32),
                        resume_offset=resume_offset, counts=PackCounts(**self.counts.to_json()))
        self._fill = 0
        self._sources, self._offsets, self._lens = [], [], []
        return window

    def tail(self) -> tuple[int, int]:
        """The partial sequence left at the end: ``(tokens, documents that begin in it)``; it is dropped."""
        return self._fill, sum(1 for offset in self._offsets if offset == 0)
