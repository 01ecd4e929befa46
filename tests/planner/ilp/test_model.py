import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from flashcp.costmodel.workload import rank_workloads, token_quotas, workload
from flashcp.planner.ilp.blocks import (
    block_grid,
    rank_sums,
    round_plan_to_blocks,
)
from flashcp.planner.ilp.model import IlpOptions, normalised_objective, solve_sequence
from tests.audit_helpers import greedy_plan
from tests.naive import naive_block_optimum


def options(**kw) -> IlpOptions:
    return IlpOptions(**{"time_limit_s": 10.0, "num_workers": 1, **kw})


@st.composite
def small_instances(draw, max_blocks=7):
    granularity = draw(st.integers(1, 3))
    doc_lens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    cp = draw(st.integers(1, 3))
    assume(sum(-(-n // granularity) for n in doc_lens) <= max_blocks and sum(doc_lens) >= cp)
    return doc_lens, cp, granularity


def test_hand_instance_one_token_blocks():
    # Documents [3, 1], 2 ranks, blocks of 1 token, quota 2 tokens each. Token workloads: document 0 has
    # 1, 2, 3 (positions 0..2), document 1 has 1; total 7, mean 3.5. One rank holds document 1 plus one token
    # of document 0, the other two tokens of document 0 (document 0 has 3 tokens, it cannot stay whole):
    #   doc1 + pos0: 2 vs 5 -> max 5;  doc1 + pos1: 3 vs 4 -> max 4;  doc1 + pos2: 4 vs 3 -> max 4.
    # Splitting document 1 is impossible (1 token). Among max 4: pos1 alone on the doc-1 rank gives shards
    # [0,1) B, [1,2) A, [2,3) B: each rank sends one non-last token -> ag 1; pos2 on the doc-1 rank gives
    # [0,2) B, [2,3) A: rank B sends 2 -> ag 2. Optimum: imbalance 4 / 3.5 = 8/7, ag 1, and
    # the weighted objective 8/7 + 1 * 1 / (4 / 2) = 8/7 + 1/2 (max 5 plans cost at least 10/7 + 1/2).
    for lexicographic in (False, True):
        result = solve_sequence([3, 1], 2, options(granularity=1, lexicographic=lexicographic))
        assert result.status == "OPTIMAL"
        assert result.metrics.imbalance == pytest.approx(8 / 7)
        assert result.metrics.ag_comm_tokens == 1
        assert result.gap == 0
        result.plan.validate([3, 1])
    weighted = solve_sequence([3, 1], 2, options(granularity=1))
    assert weighted.objective == pytest.approx(8 / 7 + 1 / 2)
    assert weighted.bound == pytest.approx(8 / 7 + 1 / 2)


def test_hand_instance_two_token_blocks():
    # Documents [6, 2], 2 ranks, blocks of 2, quota 4 each. Blocks of document 0: [0,2) W 3, [2,4) W 7,
    # [4,6) W 11; document 1: one block, W 3. Total 24, mean 12. Each rank holds two blocks; the rank with
    # document 1 takes one block of document 0: +3 -> 6 vs 18, +7 -> 10 vs 14, +11 -> 14 vs 10.
    # Best max workload 14 (imbalance 7/6), twice: doc1 + [2,4) leaves [0,2), [4,6) on the other rank:
    # shards [0,2) B, [2,4) A, [4,6) B -> each rank sends 2 tokens, ag 2; doc1 + [4,6) leaves [0,4) on B,
    # which B sends whole: ag 4. Document 0 (6 tokens) must be split, so ag >= 2 in every plan.
    # Optimum: imbalance 7/6, ag 2, weighted objective 7/6 + 2 / 4 = 5/3.
    result = solve_sequence([6, 2], 2, options(granularity=2))
    assert result.status == "OPTIMAL" and result.num_blocks == 4
    assert (result.metrics.imbalance, result.metrics.ag_comm_tokens) == (pytest.approx(7 / 6), 2)
    assert result.objective == pytest.approx(5 / 3)
    assert sorted(zip(result.plan.shard_doc.tolist(), result.plan.shard_start.tolist(),
                      result.plan.shard_len.tolist())) == [(0, 0, 2), (0, 2, 2), (0, 4, 2), (1, 0, 2)]


@settings(max_examples=40, deadline=None)
@given(small_instances(), st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.booleans(), st.booleans())
def test_ilp_matches_brute_force(instance, comm_weight, lexicographic, break_symmetry):
    doc_lens, cp, granularity = instance
    result = solve_sequence(doc_lens, cp, options(granularity=granularity, comm_weight=comm_weight,
                                                  lexicographic=lexicographic, break_symmetry=break_symmetry),
                            quota_slack=0)
    best = naive_block_optimum(doc_lens, cp, granularity, comm_weight=comm_weight,
                               lexicographic=lexicographic)
    if best is None:
        assert result.status == "INFEASIBLE" and result.plan is None
        return
    assert result.status == "OPTIMAL"
    result.plan.validate(doc_lens)
    m, context_len = result.metrics, sum(doc_lens)
    if lexicographic:
        assert m.imbalance == pytest.approx(best[0], rel=1e-12) and m.ag_comm_tokens == best[1]
    else:
        # the weight is applied to CP-SAT within 1 / total workload
        tolerance = 1e-9 + comm_weight * cp / (2 * sum(workload(0, n) for n in doc_lens))
        assert normalised_objective(m, context_len, cp, comm_weight) == pytest.approx(best[0], abs=tolerance)
        assert result.objective == pytest.approx(best[0], abs=tolerance)


@settings(max_examples=25, deadline=None)
@given(small_instances())
def test_workload_cap_minimises_comm_under_the_cap(instance):
    doc_lens, cp, granularity = instance
    cap = int(1.2 * sum(workload(0, n) for n in doc_lens) / cp)  # some instances cannot meet it
    result = solve_sequence(doc_lens, cp, options(granularity=granularity), quota_slack=0, workload_cap=cap)
    best = naive_block_optimum(doc_lens, cp, granularity, workload_cap=cap)
    if best is None:
        assert result.status == "INFEASIBLE"
    else:
        assert result.status == "OPTIMAL" and result.metrics.ag_comm_tokens == best[0]
        assert result.metrics.imbalance * sum(workload(0, n) for n in doc_lens) / cp <= cap + 1e-6


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=2, max_size=6), st.integers(2, 3), st.sampled_from([1, 2]))
def test_ilp_is_never_worse_than_the_rounded_heuristic(doc_lens, cp, granularity):
    assume(sum(doc_lens) >= cp)
    heuristic = greedy_plan(doc_lens, cp)
    grid = block_grid(doc_lens, granularity)
    rounded = round_plan_to_blocks(heuristic, grid)
    result = solve_sequence(doc_lens, cp, options(granularity=granularity, time_limit_s=5.0), hint=heuristic)
    assert result.plan is not None
    context_len = sum(doc_lens)
    got = normalised_objective(result.metrics, context_len, cp, 1.0)
    if granularity == 1:  # one-token blocks: the heuristic plan is on the grid, rounding is exact
        assert np.array_equal(rank_sums(grid.length, rounded, cp), token_quotas(context_len, cp))
        heuristic_objective = normalised_objective(heuristic.metrics(), context_len, cp, 1.0)
        assert result.hint_metrics == heuristic.metrics()
        assert got <= heuristic_objective + 1e-9
    if result.hint_metrics is not None:  # the warm start the solver was given (rounded, repaired)
        assert got <= normalised_objective(result.hint_metrics, context_len, cp, 1.0) + 1e-9


def test_impossible_quotas_are_reported_then_relaxed():
    # 2 ranks, quota 1024 tokens each; blocks of 1024 keep every document whole: 1000, 1000 and 48 tokens
    # make 1000, 1048 or 2048 per rank, never 1024.
    exact = solve_sequence([1000, 1000, 48], 2, options(granularity=1024), quota_slack=0)
    assert exact.status == "INFEASIBLE" and exact.plan is None and exact.objective is None
    relaxed = solve_sequence([1000, 1000, 48], 2, options(granularity=1024))
    assert relaxed.exact_status == "INFEASIBLE"
    assert relaxed.quota_slack == 1000 and relaxed.plan is not None
    tokens = rank_sums(relaxed.plan.shard_len, relaxed.plan.shard_rank, 2)
    assert (np.abs(tokens - 1024) <= 1000).all()
    # the same request at granularity 8 is possible: the exact model solves it
    fine = solve_sequence([1000, 1000, 48], 2, options(granularity=8))
    assert fine.quota_slack == 0 and fine.exact_status is None
    fine.plan.validate([1000, 1000, 48])


def test_unreachable_workload_cap_is_infeasible_not_an_error():
    result = solve_sequence([4, 4], 2, options(granularity=1), quota_slack=0, workload_cap=9)  # best is 10
    assert result.status == "INFEASIBLE" and result.plan is None


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="granularity"):
        IlpOptions(granularity=0)
    with pytest.raises(ValueError, match="time_limit_s"):
        IlpOptions(time_limit_s=0)
    with pytest.raises(ValueError, match="ranks"):
        solve_sequence([4, 4], 2, options(), hint=greedy_plan([4, 4], 4))


def test_workload_cap_skips_the_reach_stage_when_the_warm_start_meets_it():
    doc_lens, cp = [7, 7, 7, 11], 2
    heuristic = greedy_plan(doc_lens, cp)  # cuts at whole tokens: on the grid of one-token blocks
    cap = int(rank_workloads(heuristic.shard_start, heuristic.shard_len, heuristic.shard_rank, cp).max())
    warm = solve_sequence(doc_lens, cp, options(granularity=1, time_limit_s=3.0), hint=heuristic,
                          workload_cap=cap)
    assert [s.name for s in warm.stages] == ["capped-comm"]
    assert warm.metrics.ag_comm_tokens <= heuristic.metrics().ag_comm_tokens
    assert warm.metrics.imbalance <= heuristic.metrics().imbalance + 1e-12
    cold = solve_sequence(doc_lens, cp, options(granularity=1, time_limit_s=3.0), workload_cap=cap)
    assert [s.name for s in cold.stages] == ["reach-cap", "capped-comm"]
    assert cold.metrics.imbalance <= heuristic.metrics().imbalance + 1e-12


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(100, 3000), min_size=2, max_size=12), st.integers(2, 4))
def test_ilp_with_plan_cuts_is_never_worse_than_the_plan(doc_lens, cp):
    heuristic = greedy_plan(doc_lens, cp)
    result = solve_sequence(doc_lens, cp, options(granularity=512, hint_cuts=True, time_limit_s=2.0),
                            hint=heuristic)
    context_len = sum(doc_lens)
    assert result.quota_slack == 0 and result.hint_metrics == heuristic.metrics()
    result.plan.validate(doc_lens)
    assert (normalised_objective(result.metrics, context_len, cp, 1.0)
            <= normalised_objective(heuristic.metrics(), context_len, cp, 1.0) + 1e-9)
