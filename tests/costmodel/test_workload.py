"""Workload and equal-token quotas (flashcp.costmodel.workload)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel.workload import KIND_CODES, key_start, kind_workload, kind_workloads, token_quotas, workload
from tests.naive import naive_first_key, naive_kind_workload, naive_workload


@settings(deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10_000))
def test_workload_matches_pair_count(start, length):
    assert workload(start, length) == naive_workload(start, length)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["full", "window", "chunk"]), st.integers(1, 300), st.integers(0, 2000),
       st.integers(1, 700))
def test_kind_workload_matches_pair_count(kind, size, start, length):
    size = None if kind == "full" else size
    code = KIND_CODES[kind]
    want = naive_kind_workload(kind, size, start, length)
    assert kind_workload(code, size or 0, start, length) == want
    assert kind_workloads(code, size or 0, np.array([start]), np.array([length])).tolist() == [want]
    # the shard's first key is its first query's (the bound only grows with the position)
    assert key_start(code, size or 0, start) == min(naive_first_key(kind, size, p)
                                                    for p in range(start, start + length))


def test_kind_workload_of_a_window_past_the_document_is_full():
    assert kind_workload(KIND_CODES["window"], 5000, 100, 400) == workload(100, 400)
    assert kind_workload(KIND_CODES["chunk"], 5000, 100, 400) == workload(100, 400)
    # window 4 over positions 2..9: 3 + 4 * 7
    assert kind_workload(KIND_CODES["window"], 4, 2, 8) == 31


@pytest.mark.parametrize("context_len,cp", [(16, 4), (17, 4), (131072, 8), (131071, 3), (5, 5)])
def test_token_quotas_are_equal_and_sum(context_len, cp):
    quotas = token_quotas(context_len, cp)
    assert quotas.sum() == context_len
    assert quotas.max() - quotas.min() <= 1
    assert (np.diff(quotas) <= 0).all(), "the first C % N ranks get the extra token"


def test_imbalance_ratio_is_max_over_mean():
    from flashcp.costmodel.workload import imbalance_of, imbalance_ratio

    rng = np.random.default_rng(0)
    for cp in (1, 2, 8, 16):
        work = rng.integers(0, 1 << 40, cp)
        assert imbalance_ratio(work) == work.max() / work.mean() == imbalance_of(work)
    assert imbalance_ratio([0, 0, 0]) == 1.0
    with pytest.raises(ValueError, match="one workload per rank"):
        imbalance_ratio([])
