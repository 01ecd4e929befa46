"""The streaming packer against the token-at-a-time reference, including resuming at any sequence boundary."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.data.packing import OVERFLOWS, PackCounts, Packer
from tests.naive import naive_pack


def pack_all(docs, context_len, overflow):
    packer = Packer(context_len, overflow)
    windows, points = [], []
    for index, doc in enumerate(docs):
        for window in packer.add(index, np.asarray(doc, np.int32)):
            windows.append(window)
            points.append(index)
    return packer, windows, points


def as_rows(windows):
    return [(w.tokens.tolist(), list(zip(w.doc_source.tolist(), w.doc_offset.tolist(), w.doc_lens.tolist())))
            for w in windows]


docs_strategy = st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=40), max_size=30)


@settings(max_examples=200, deadline=None)
@given(docs=docs_strategy, context_len=st.integers(1, 25), overflow=st.sampled_from(["split", "truncate"]))
def test_packer_matches_reference(docs, context_len, overflow):
    packer, windows, _ = pack_all(docs, context_len, overflow)
    rows, tail, num_split, num_truncated, tokens_truncated = naive_pack(docs, context_len, overflow)
    assert as_rows(windows) == rows
    # every document's first piece is in a closed sequence or begins in the tail
    assert packer.tail() == (tail, len(docs) - sum(int((w.doc_offset == 0).sum()) for w in windows))
    assert packer.counts == PackCounts(documents_split=num_split, documents_truncated=num_truncated,
                                       tokens_truncated=tokens_truncated)
    for w in windows:
        assert w.tokens.dtype == np.int32 and w.tokens.size == context_len
        assert int(w.doc_lens.sum()) == context_len and (w.doc_lens > 0).all()
    assert sum(map(len, docs)) == len(windows) * context_len + tail + tokens_truncated


@settings(max_examples=100, deadline=None)
@given(docs=docs_strategy, context_len=st.integers(1, 25), overflow=st.sampled_from(["split", "truncate"]))
def test_resume_at_every_boundary_gives_the_same_sequences(docs, context_len, overflow):
    """A run restarted from any sequence boundary (its resume point and counts) ends exactly like one run."""
    full, windows, points = pack_all(docs, context_len, overflow)
    for k, (window, doc_index) in enumerate(zip(windows, points)):
        packer = Packer(context_len, overflow, window.counts)
        first = doc_index if window.resume_offset else doc_index + 1
        rest = []
        for index in range(first, len(docs)):
            start = window.resume_offset if index == doc_index else 0
            rest.extend(packer.add(index, np.asarray(docs[index], np.int32), start))
        assert as_rows(rest) == as_rows(windows[k + 1:])
        assert packer.counts == full.counts
        assert packer.tail() == full.tail()


def test_long_document_spans_sequences_with_offsets():
    packer = Packer(4, "split")
    windows = packer.add(7, np.arange(10, dtype=np.int32))
    assert [w.doc_offset.tolist() for w in windows] == [[0], [4]]
    assert [w.resume_offset for w in windows] == [4, 8]
    assert packer.tail() == (2, 0)  # the rest is a continuation, not a document of its own
    assert packer.counts.documents_split == 1


def test_truncate_drops_the_rest_and_counts_it():
    packer = Packer(4, "truncate")
    assert packer.add(0, np.arange(3, dtype=np.int32)) == []
    (window,) = packer.add(1, np.arange(5, dtype=np.int32))
    assert window.doc_lens.tolist() == [3, 1] and window.resume_offset == 0
    assert packer.counts == PackCounts(documents_split=0, documents_truncated=1, tokens_truncated=4)


@pytest.mark.parametrize("overflow", OVERFLOWS)
def test_lengths_only_closes_the_same_sequences_as_the_packer(overflow):
    rng = np.random.default_rng(0)
    for context_len in (1, 7, 64):
        tokens_packer = Packer(context_len, overflow, PackCounts(documents_split=3))
        lengths = Packer(context_len, overflow, PackCounts(documents_split=3), lengths_only=True)
        for doc in range(400):
            n = int(rng.choice([1, 2, context_len, context_len + 1, 3 * context_len + 2, rng.integers(1, 200)]))
            start = int(rng.integers(0, n)) if doc % 50 == 0 else 0
            windows = tokens_packer.add(doc, np.arange(n, dtype=np.int32), start)
            closed = lengths.add_length(n, start)
            assert [(w.resume_offset, w.counts) for w in closed] == [(w.resume_offset, w.counts) for w in windows]
            assert all(w.tokens is None and w.doc_lens is None for w in closed)
            assert lengths.tail() == tokens_packer.tail()
        assert lengths.counts == tokens_packer.counts


def test_lengths_only_resumes_inside_a_sequence():
    lengths = [5, 9, 2, 13, 4, 1, 8]
    whole = Packer(6, "split", lengths_only=True)
    closed = [w.resume_offset for n in lengths for w in whole.add_length(n)]
    first = Packer(6, "split", lengths_only=True)
    head = [w.resume_offset for n in lengths[:3] for w in first.add_length(n)]
    second = Packer(6, "split", lengths_only=True)
    second.resume(*first.tail(), first.counts)  # the state a layout elsewhere stopped in
    assert head + [w.resume_offset for n in lengths[3:] for w in second.add_length(n)] == closed
    assert second.tail() == whole.tail() and second.counts == whole.counts
    with pytest.raises(ValueError, match="a lengths-only packer is fed lengths"):
        second.add(0, np.arange(3, dtype=np.int32))
    with pytest.raises(ValueError, match="a packer of tokens is fed tokens"):
        Packer(6).add_length(3)
    with pytest.raises(ValueError, match="resumes only at a sequence boundary"):
        Packer(6).resume(2, 1, PackCounts())


def test_bad_arguments():
    with pytest.raises(ValueError, match="overflow"):
        Packer(8, "wrap")
    with pytest.raises(ValueError, match="context_len"):
        Packer(0)
