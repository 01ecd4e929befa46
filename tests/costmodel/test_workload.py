"""Workload and equal-token quotas (flashcp.costmodel.workload)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel.workload import token_quotas, workload
from tests.naive import naive_workload


@settings(deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10_000))
def test_workload_matches_pair_count(start, length):
    assert workload(start, length) == naive_workload(start, length)


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
