"""Block grids for the CP-SAT models (flashcp.planner.ilp.blocks): cuts, round trips, rounding, quota repair."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashcp.costmodel.comm import allgather_contributions
from flashcp.costmodel.workload import token_quotas, workload
from flashcp.planner.ilp.blocks import (
    block_grid,
    block_plan,
    rank_sums,
    repair_to_quotas,
    round_plan_to_blocks,
    sent_blocks,
)
from tests.audit_helpers import greedy_plan


def test_block_grid_cuts_documents():
    grid = block_grid([5, 2, 4], 2)
    assert grid.doc.tolist() == [0, 0, 0, 1, 2, 2]
    assert grid.start.tolist() == [0, 2, 4, 0, 0, 2]
    assert grid.length.tolist() == [2, 2, 1, 2, 2, 2]  # the last block of document 0 is shorter
    assert grid.doc_offsets.tolist() == [0, 3, 4, 6]
    assert grid.has_next.tolist() == [True, True, False, False, True, False]
    # workloads add up over consecutive blocks to the whole document's
    assert grid.workloads[:3].sum() == workload(0, 5)
    with pytest.raises(ValueError, match="granularity"):
        block_grid([5], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(1, 8), st.integers(1, 4),
       st.randoms(use_true_random=False))
def test_block_plan_round_trip_and_sent_blocks(doc_lens, granularity, cp, rnd):
    grid = block_grid(doc_lens, granularity)
    ranks = np.array([rnd.randrange(cp) for _ in range(grid.num_blocks)])
    plan = block_plan(grid, ranks, cp)
    assert np.array_equal(round_plan_to_blocks(plan, grid), ranks)
    # a block is sent iff it lies in a shard the all-gather definition contributes
    sent = sent_blocks(grid, ranks)
    expected = allgather_contributions(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    assert np.array_equal(rank_sums(grid.length[sent], ranks[sent], cp), expected)


def test_rounding_takes_the_majority_rank():
    # document of 4 tokens in blocks of 4: tokens [0, 1) on rank 1, [1, 4) on rank 0 -> rank 0
    from flashcp.planner.plan import SequencePlan
    plan = SequencePlan.from_arrays([0, 0], [0, 1], [1, 3], [1, 0], 2)
    assert round_plan_to_blocks(plan, block_grid([4], 4)).tolist() == [0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=25), st.sampled_from([1, 64, 256]),
       st.integers(2, 4), st.randoms(use_true_random=False))
def test_repair_meets_the_quotas(doc_lens, granularity, cp, rnd):
    assume(sum(doc_lens) >= cp)
    grid = block_grid(doc_lens, granularity)
    quotas = token_quotas(sum(doc_lens), cp)
    ranks = np.array([rnd.randrange(cp) for _ in range(grid.num_blocks)])
    repaired = repair_to_quotas(grid, ranks, quotas)
    if granularity == 1:
        assert repaired is not None, "with one-token blocks the quotas are always reachable"
    if repaired is not None:
        assert np.array_equal(rank_sums(grid.length, repaired, cp), quotas)
        assert np.array_equal(repair_to_quotas(grid, repaired, quotas), repaired), "a plan meeting them stays"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(1, 8), st.integers(1, 4))
def test_grid_with_plan_cuts_holds_the_plan_exactly(doc_lens, granularity, cp):
    assume(sum(doc_lens) >= cp)
    plan = greedy_plan(doc_lens, cp)
    grid = block_grid(doc_lens, granularity, plan)
    assert not grid.uniform and (grid.length >= 1).all() and (grid.length <= granularity).all()
    assert np.array_equal(np.add.reduceat(grid.length, grid.doc_offsets[:-1]), doc_lens)
    ranks = round_plan_to_blocks(plan, grid)
    assert block_plan(grid, ranks, cp).metrics() == plan.metrics()
    assert np.array_equal(rank_sums(grid.length, ranks, cp), token_quotas(sum(doc_lens), cp))
