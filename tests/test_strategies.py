import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashcp.costmodel.comm import PlanMetrics
from flashcp.costmodel.workload import token_quotas
from flashcp.errors import PlanError
from flashcp.planner import check
from flashcp.planner.pipeline import plan_rows, strategy_metrics
from flashcp.planner.plan import SequencePlan, check_metrics
from flashcp.planner.registry import STRATEGIES as REGISTRY
from flashcp.planner.registry import get_strategy, plan_sequence
from tests.naive import (
    naive_flashcp,
    naive_flashcp_plus,
    naive_llama3,
    naive_metrics,
    naive_perdoc,
    naive_ring_plan,
    naive_workload,
)

REFERENCES = {"llama3": naive_llama3, "perdoc": naive_perdoc, "flashcp": naive_flashcp,
              "flashcp+": naive_flashcp_plus, "ring": naive_ring_plan}


# the Numba strategies (dcp plans in Python with an optional package: tests/test_dcp.py)
STRATEGIES = {name: s for name, s in REGISTRY.items() if s.kernel is not None}


def examples(n):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sequences(draw, max_docs=24, max_len=3000):
    """Packed sequences with a mix of short and long documents, and a CP size that fits."""
    num_docs = draw(st.integers(1, max_docs))
    long_doc = st.integers(1, max_len)
    short_doc = st.integers(1, max(1, max_len // 20))
    lens = draw(st.lists(st.one_of(short_doc, short_doc, long_doc), min_size=num_docs, max_size=num_docs))
    cp = draw(st.integers(1, min(9, sum(lens))))
    return lens, cp


def as_tuples(plan: SequencePlan):
    return list(zip(plan.shard_doc.tolist(), plan.shard_start.tolist(), plan.shard_len.tolist(),
                    plan.shard_rank.tolist()))


def assert_same_as_reference(name, lens, cp, **params):
    got = plan_sequence(name, lens, cp, **params)
    expected = REFERENCES[name](lens, cp, *params.values())
    assert as_tuples(got) == expected, f"{name} cp={cp} lens={lens}"
    got.validate(lens)
    imbalance, ag, a2a = naive_metrics(expected, cp)
    check_metrics(got, imbalance, ag, a2a)
    return got


@pytest.mark.parametrize("name", ["perdoc", "flashcp", "flashcp+", "ring"])
@examples(300)
@given(case=sequences())
def test_kernel_equals_reference(name, case):
    lens, cp = case
    assert_same_as_reference(name, lens, cp)


@examples(400)
@given(case=sequences(max_docs=12, max_len=400))
def test_llama3_equals_reference(case):
    lens, cp = case
    assert_same_as_reference("llama3", lens, cp)


@pytest.mark.parametrize("name,target", [("flashcp", 1.0), ("flashcp", 1.2), ("flashcp+", 1.0),
                                         ("flashcp+", 1.05)])
@examples(150)
@given(case=sequences(max_docs=16))
def test_kernel_equals_reference_at_other_targets(name, target, case):
    lens, cp = case
    assert_same_as_reference(name, lens, cp, target_imbalance=target)


@examples(200)
@given(case=sequences(max_docs=30, max_len=20000))
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


def test_llama3_by_hand():
    # C=16, N=2: chunks of 4 tokens; rank 0 gets [0,4) and [12,16), rank 1 gets [4,12)
    plan = plan_sequence("llama3", [6, 10], 2)
    assert as_tuples(plan) == [(0, 0, 4, 0), (1, 6, 4, 0), (0, 4, 2, 1), (1, 0, 6, 1)]


def test_perdoc_remainders_round_robin():
    # 2N = 4 chunks of 1 token each; doc 0 (5 tokens) has 1 extra token (rank 0, early chunk), doc 1
    # (6 tokens) 2 extras dealt on from the pointer: rank 1 then rank 0 (early chunks). Rank 1's two
    # chunks touch and merge. Tokens 6 and 5: the quotas of C=11 over 2 ranks.
    plan = plan_sequence("perdoc", [5, 6], 2)
    assert as_tuples(plan) == [(0, 0, 2, 0), (0, 4, 1, 0), (1, 0, 2, 0), (1, 5, 1, 0), (0, 2, 2, 1),
                               (1, 2, 3, 1)]


def test_flashcp_keeps_documents_whole_when_they_balance():
    plan = plan_sequence("flashcp", [1000] * 8 + [500] * 8, 4)
    assert plan.num_shards == 16, "every document whole on one rank"
    assert plan.metrics() == PlanMetrics(imbalance=1.0, ag_comm_tokens=0, a2a_comm_tokens=0)


def test_flashcp_plus_beats_flashcp_on_a_mixed_sequence():
    lens = [3000, 2500, 2000, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300]
    alg1, plus = (plan_sequence(name, lens, 4).metrics() for name in ("flashcp", "flashcp+"))
    assert alg1.imbalance <= 1.05 and plus.imbalance <= 1.01
    assert plus.ag_comm_tokens < alg1.ag_comm_tokens and plus.a2a_comm_tokens < alg1.a2a_comm_tokens


def test_flashcp_perdoc_fallback_for_one_dominant_document():
    lens = [60000, 100, 200, 300]
    plan = plan_sequence("flashcp", lens, 4)
    assert set(plan.shard_rank[plan.shard_doc == 0].tolist()) == {0, 1, 2, 3}
    assert plan.metrics().imbalance <= 1.05


def test_flashcp_plus_balances_and_keeps_the_tail_whole():
    lens = [30000, 5000, 4000, 3000, 2500, 2000, 1500, 1000, 800, 600, 400, 200, 100]
    plan = plan_sequence("flashcp+", lens, 4)
    assert plan.metrics().imbalance <= 1.01
    last = plan.shard_start[plan.shard_doc == 0].max()
    tail = plan.shard_len[(plan.shard_doc == 0) & (plan.shard_start == last)][0]
    assert tail > 30000 // 8, "the heavy document's tail stays whole on one rank"


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

def _broken_plans():
    lens = [5, 3, 8]
    good = plan_sequence("flashcp", lens, 2)
    arrays = [good.shard_doc.copy(), good.shard_start.copy(), good.shard_len.copy(), good.shard_rank.copy()]
    yield "good", lens, arrays, check.OK
    a = [x.copy() for x in arrays]
    a[2][0] += 1  # rank 0's first shard of doc 0 grows into the next shard, its doc-2 shard shrinks
    a[2][4] -= 1
    yield "overlap", lens, a, check.BAD_COVERAGE
    a = [x.copy() for x in arrays]
    a[3][0] = 1 - a[3][0]
    yield "quota", lens, a, check.BAD_QUOTA
    a = [x.copy() for x in arrays]
    a[3][0] = 5
    yield "rank", lens, a, check.BAD_RANK
    a = [x[1:].copy() for x in arrays]
    yield "gap", lens, a, check.BAD_COVERAGE
    a = [x.copy() for x in arrays]
    a[0][0] = 9
    yield "doc", lens, a, check.BAD_DOC
    a = [x.copy() for x in arrays]
    a[2][0] = 0
    yield "empty", lens, a, check.BAD_LENGTH


BROKEN = ["good", "overlap", "quota", "rank", "gap", "doc", "empty"]


@pytest.mark.parametrize("label", BROKEN)
def test_check_batch_agrees_with_validate(label):
    # built here, not at collection: collecting the suite plans nothing (tests/conftest.py)
    cases = {case[0]: case[1:] for case in _broken_plans()}
    assert list(cases) == BROKEN
    lens, arrays, code = cases[label]
    offsets = np.array([0, len(lens)])
    shard_offsets = np.array([0, arrays[0].size])
    errors, *_ = check.check_batch(offsets, np.asarray(lens, np.int64), shard_offsets, *arrays, 2, 0.0)
    assert errors[0] == code, label
    plan = SequencePlan.from_arrays(*arrays, cp=2)
    if code == check.OK:
        plan.validate(lens)
    else:
        with pytest.raises(PlanError):
            plan.validate(lens)


@pytest.mark.parametrize("dist", ["wlb", "prolong", "pile"])
def test_quality_on_synthetic_sequences(dist):
    # seeded checks at the paper's scale; bench/plan_quality.py reports the full numbers
    from flashcp.data.synth import load_distribution, pack_lengths

    offsets, lens, _, _, _ = pack_lengths(load_distribution(dist), np.random.default_rng(11), 150, 131072)
    rows = {name: plan_rows(offsets, lens, 8, name) for name in ("flashcp", "flashcp+")}
    alg1, plus = rows["flashcp"], rows["flashcp+"]
    assert alg1.imbalance.max() <= 1.05 and plus.imbalance.max() <= 1.01
    assert plus.imbalance.mean() < alg1.imbalance.mean()
    assert plus.ag_comm_tokens.mean() < alg1.ag_comm_tokens.mean()
    assert plus.a2a_comm_tokens.mean() < alg1.a2a_comm_tokens.mean()
