"""The streaming packer: documents in input order fill sequences of exactly ``context_len`` tokens.

Each document (its ids, EOS included) is laid into the current sequence. When the sequence fills up in the
middle of a document, the rest of the document either continues at the start of the next sequence as a new
piece whose ``doc_offset`` is its offset inside the document (``overflow="split"``), or is dropped
(``overflow="truncate"``, the FlashCP paper's setting: "the last document is truncated to fit"). What is left
in the last, partial sequence when the input ends is the *tail*: it is never written, only counted.

The packer holds one sequence at a time, so memory does not grow with the input. ``tests/naive.py`` has a
token-at-a-time reference that the tests compare it with. A *lengths-only* packer runs the same loop on
document lengths alone: the same sequence boundaries and counts, no tokens (the Ray engine's driver lays out a
pack this way, ``flashcp.engines.ray_pack``; ``flashcp.engines._layout`` is the loop's Numba twin).
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

    tokens: np.ndarray | None
    """(context_len,) int32 token ids; None from a lengths-only packer (so are the three piece arrays)."""
    doc_lens: np.ndarray | None
    """(pieces,) int32 piece lengths, summing to context_len, none 0."""
    doc_source: np.ndarray | None
    """(pieces,) int64 index of each piece's document in input order."""
    doc_offset: np.ndarray | None
    """(pieces,) int32 offset of each piece inside its document."""
    resume_offset: int
    """Offset inside the document being added at which the next sequence starts; 0 when it starts with the
    next document."""
    counts: PackCounts
    """The packer's counts right after this sequence was closed."""


class Packer:
    """Packs documents, fed one at a time with ``add``, into Windows of exactly ``context_len`` tokens.

    With ``lengths_only`` it is fed lengths with ``add_length`` instead, and its Windows carry only where the
    next sequence starts and the counts.
    """

    def __init__(self, context_len: int, overflow: str = "split", counts: PackCounts | None = None, *,
                 lengths_only: bool = False):
        if context_len < 1:
            raise ValueError(f"context_len must be at least 1, got {context_len}")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOWS)}, got {overflow!r}")
        self.context_len = context_len
        self.overflow = overflow
        self.lengths_only = lengths_only
        self.counts = PackCounts(**counts.to_json()) if counts is not None else PackCounts()
        self._tokens = None if lengths_only else np.empty(context_len, np.int32)
        self._fill = 0
        self._starts = 0  # pieces of the open sequence that begin their document
        self._sources: list[int] = []
        self._offsets: list[int] = []
        self._lens: list[int] = []

    def add(self, doc_index: int, tokens: np.ndarray, start: int = 0) -> list[Window]:
        """Lay ``tokens[start:]`` of document ``doc_index`` into the sequence; return the sequences it closed.

        ``tokens`` (n,) int32 is the whole document (EOS included); ``start`` > 0 resumes a document that an
        earlier run had already placed up to ``start``.
        """
        if self.lengths_only:
            raise ValueError("a lengths-only packer is fed lengths (add_length), not tokens")
        return self._lay(doc_index, len(tokens), start, tokens)

    def add_length(self, n: int, start: int = 0) -> list[Window]:
        """Lengths-only: lay tokens ``[start, n)`` of a document of ``n`` tokens; return the sequences it closed."""
        if not self.lengths_only:
            raise ValueError("a packer of tokens is fed tokens (add), not lengths")
        return self._lay(-1, n, start, None)

    def resume(self, fill: int, starts: int, counts: PackCounts) -> None:
        """Lengths-only: continue from where a layout of the same lengths elsewhere stopped.

        That is an open sequence of ``fill`` tokens in which ``starts`` documents begin, and ``counts`` (the
        Ray driver's Numba layout, ``flashcp.engines._layout``, hands its state over so).
        """
        if not self.lengths_only:
            raise ValueError("a packer of tokens resumes only at a sequence boundary (it would need the tokens)")
        self._fill, self._starts, self.counts = fill, starts, PackCounts(**counts.to_json())

    def _lay(self, doc_index: int, n: int, start: int, tokens: np.ndarray | None) -> list[Window]:
        """The packing loop: ``tokens`` (or, lengths-only, None) ``[start, n)`` into the open sequence."""
        context_len = self.context_len
        pos = start
        closed: list[Window] = []
        while pos < n:
            take = min(n - pos, context_len - self._fill)
            if tokens is not None and self._tokens is not None:
                self._tokens[self._fill:self._fill + take] = tokens[pos:pos + take]
                self._sources.append(doc_index)
                self._offsets.append(pos)
                self._lens.append(take)
            self._starts += pos == 0
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
        counts = PackCounts(**self.counts.to_json())
        if self._tokens is None:
            window = Window(tokens=None, doc_lens=None, doc_source=None, doc_offset=None,
                            resume_offset=resume_offset, counts=counts)
        else:
            window = Window(tokens=self._tokens.copy(), doc_lens=np.array(self._lens, np.int32),
                            doc_source=np.array(self._sources, np.int64),
                            doc_offset=np.array(self._offsets, np.int32), resume_offset=resume_offset,
                            counts=counts)
        self._fill = self._starts = 0
        self._sources, self._offsets, self._lens = [], [], []
        return window

    def tail(self) -> tuple[int, int]:
        """The partial sequence left at the end: ``(tokens, documents that begin in it)``; it is dropped."""
        return self._fill, self._starts
