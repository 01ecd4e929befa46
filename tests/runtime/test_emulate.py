"""The single-process emulation of every rank (tests.emulate) against float64 dense attention with a document
mask, on random and baseline plans, every comm mode."""

import numpy as np
import pytest
from hypothesis import given, settings

from tests.plans import llama3_like_plan, perdoc_like_plan
from tests.runtime import check_plan, random_cases


@settings(max_examples=40, deadline=None)
@given(random_cases())
def test_emulated_random_plans_match_dense_reference(case):
    plan, doc_lens, (num_heads, num_kv_heads) = case
    check_plan(plan, doc_lens, num_heads, num_kv_heads)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_emulated_baseline_plans_match_dense_reference(cp):
    rng = np.random.default_rng(cp)
    doc_lens = rng.integers(1, 15, size=5)
    check_plan(llama3_like_plan(doc_lens, cp), doc_lens)
    doc_lens = 2 * cp * rng.integers(1, 4, size=3)
    check_plan(perdoc_like_plan(doc_lens, cp), doc_lens, num_kv_heads=4)
