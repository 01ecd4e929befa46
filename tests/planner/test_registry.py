"""The strategy registry and every Numba strategy against the plain-Python references: equal plans, quotas for
any context length, sorted and merged shards, the batch planner and the stored metrics."""

import numpy as np
import pytest
from hypothesis import given

from flashcp.costmodel.workload import token_quotas
from flashcp.planner.plan import check_metrics
from flashcp.planner.planning import plan_rows, plan_sequence, strategy_metrics
from flashcp.planner.registry import STRATEGIES as REGISTRY
from flashcp.planner.registry import get_strategy
from tests.naive import (
    naive_workload,
)
from tests.plans import as_tuples, assert_same_as_reference, examples, mixed_sequences

# the Numba strategies (dcp plans in Python with an optional package: tests/planner/strategies/test_dcp.py)
STRATEGIES = {name: s for name, s in REGISTRY.items() if s.kernel is not None}


@pytest.mark.parametrize("name", ["perdoc", "flashcp", "flashcp+", "ring"])
@examples(300)
@given(case=mixed_sequences())
def test_kernel_equals_reference(name, case):
    lens, cp = case
    assert_same_as_reference(name, lens, cp)


@pytest.mark.parametrize("name,target", [("flashcp", 1.0), ("flashcp", 1.2), ("flashcp+", 1.0),
                                         ("flashcp+", 1.05)])
@examples(150)
@given(case=mixed_sequences(max_docs=16))
def test_kernel_equals_reference_at_other_targets(name, target, case):
    lens, cp = case
    assert_same_as_reference(name, lens, cp, target_imbalance=target)


@examples(200)
@given(case=mixed_sequences(max_docs=30, max_len=20000))
def test_batch_equals_single_sequences_and_metrics(case):
    lens, cp = case
    sequences_ = [lens, lens[::-1], [sum(lens)], [1] * min(sum(lens), 50) + [max(1, sum(lens) - 50)]]
    sequences_ = [s for s in sequences_ if sum(s) >= cp]
    offsets = np.r_[0, np.cumsum([len(s) for s in sequences_])]
    flat = np.concatenate([np.asarray(s) for s in sequences_])
    for name in STRATEGIES:
        rows = plan_rows(offsets, flat, cp, name)
        for i, s in enumerate(sequences_):
            lo, hi = rows.shard_offsets[i], rows.shard_offsets[i + 1]
            single = plan_sequence(name, s, cp)
            assert np.array_equal(rows.shard_doc[lo:hi], single.shard_doc)
            assert np.array_equal(rows.shard_start[lo:hi], single.shard_start)
            assert np.array_equal(rows.shard_len[lo:hi], single.shard_len)
            assert np.array_equal(rows.shard_rank[lo:hi], single.shard_rank)
            check_metrics(single, rows.imbalance[i], rows.ag_comm_tokens[i], rows.a2a_comm_tokens[i])


@pytest.mark.parametrize("context_len,cp", [(131072, 8), (131071, 8), (131075, 3), (1000, 7), (9, 9), (5, 1)])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_quotas_without_divisibility(name, context_len, cp):
    rng = np.random.default_rng(context_len + cp)
    lens = []
    while sum(lens) < context_len:
        lens.append(int(min(context_len - sum(lens), rng.integers(1, max(2, context_len // 3)))))
    plan = plan_sequence(name, lens, cp)
    plan.validate(lens)
    tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp)
    assert np.array_equal(tokens, token_quotas(context_len, cp))


def test_shards_are_sorted_and_merged():
    lens = [50, 3, 400, 1, 1, 200, 77]
    for name in STRATEGIES:
        plan = plan_sequence(name, lens, 4)
        assert as_tuples(plan) == as_tuples(plan.sorted())
        keys = list(zip(plan.shard_rank.tolist(), plan.shard_doc.tolist()))
        ends = (plan.shard_start + plan.shard_len).tolist()
        for i in range(1, plan.num_shards):
            touching = keys[i] == keys[i - 1] and ends[i - 1] == plan.shard_start[i]
            assert not touching, f"{name}: shards {i - 1} and {i} touch"


def test_single_document_and_tiny_cases():
    for name in STRATEGIES:
        plan_sequence(name, [7], 7).validate([7])
        plan_sequence(name, [1, 1, 1], 3).validate([1, 1, 1])
        plan_sequence(name, [100], 1).validate([100])


def test_workload_sum_is_preserved():
    lens = [900, 30, 1200, 7, 450, 64]
    total = sum(naive_workload(0, d) for d in lens)
    for name in STRATEGIES:
        plan = plan_sequence(name, lens, 3)
        got = sum(naive_workload(int(s), int(n)) for s, n in zip(plan.shard_start, plan.shard_len))
        assert got == total


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown strategy"):
        get_strategy("zigzag")
    with pytest.raises(ValueError, match="above the 10 tokens"):
        plan_sequence("flashcp", [4, 6], 11)
    with pytest.raises(ValueError, match="at least 1"):
        plan_sequence("flashcp", [4, 6], 0)
    with pytest.raises(ValueError, match="positive"):
        plan_sequence("flashcp", [4, 0], 2)
    with pytest.raises(ValueError, match="takes no target"):
        plan_sequence("llama3", [4, 6], 2, target_imbalance=1.1)


def test_strategy_metrics_helper():
    seqs = [np.array([100, 200, 50]), np.array([350])]
    m = strategy_metrics(seqs, 2, "flashcp+")
    assert m["imbalance"].shape == (2,)
    for i, s in enumerate(seqs):
        got = plan_sequence("flashcp+", s, 2).metrics()
        assert m["ag_comm_tokens"][i] == got.ag_comm_tokens
        assert m["a2a_comm_tokens"][i] == got.a2a_comm_tokens


# --- the batch checker against SequencePlan.validate on broken plans


@pytest.mark.parametrize("dist", ["wlb", "prolong", "pile"])
def test_quality_on_synthetic_sequences(dist):
    # seeded checks at the paper's scale; `flashcp bench --scenario quality` reports the full numbers
    from flashcp.data.synth import load_distribution, pack_lengths

    offsets, lens, _, _, _ = pack_lengths(load_distribution(dist), np.random.default_rng(11), 150, 131072)
    rows = {name: plan_rows(offsets, lens, 8, name) for name in ("flashcp", "flashcp+")}
    alg1, plus = rows["flashcp"], rows["flashcp+"]
    assert alg1.imbalance.max() <= 1.05 and plus.imbalance.max() <= 1.01
    assert plus.imbalance.mean() < alg1.imbalance.mean()
    assert plus.ag_comm_tokens.mean() < alg1.ag_comm_tokens.mean()
    assert plus.a2a_comm_tokens.mean() < alg1.a2a_comm_tokens.mean()
