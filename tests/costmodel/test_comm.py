import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel.comm import (
    allgather_shard_mask,
    comm_saving,
    exchange_volumes,
    kind_local_mask,
    kv_bytes_per_token,
    plan_metrics,
)
from flashcp.costmodel.workload import KIND_CODES
from flashcp.planner import plan_sequence
from tests.naive import naive_exchange_volumes, naive_local_shards, naive_metrics
from tests.plans import packed


@st.composite
def random_shards(draw):
    cp = draw(st.integers(1, 4))
    num_docs = draw(st.integers(1, 5))
    shards = []
    for doc in range(num_docs):
        length = draw(st.integers(1, 12))
        cuts = sorted(draw(st.sets(st.integers(1, length - 1), max_size=3))) if length > 1 else []
        bounds = [0, *cuts, length]
        for a, b in zip(bounds, bounds[1:]):
            shards.append((doc, a, b - a, draw(st.integers(0, cp - 1))))
    return shards, cp


@settings(max_examples=300, deadline=None)
@given(random_shards())
def test_plan_metrics_match_naive(case):
    shards, cp = case
    doc, start, length, rank = (np.array(c) for c in zip(*shards))
    got = plan_metrics(doc, start, length, rank, cp)
    imbalance, ag, a2a = naive_metrics(shards, cp)
    assert got.imbalance == pytest.approx(imbalance, rel=1e-12)
    assert (got.ag_comm_tokens, got.a2a_comm_tokens) == (ag, a2a)


def test_metric_example_by_hand():
    # doc 0 (4 tokens) split [0,2) on rank 0 and [2,4) on rank 1; doc 1 (4 tokens) whole on rank 0... rank 1.
    # rank 0: W = 3; rank 1: W(2,2) = 7 plus W(0,4) = 10 -> 17; mean 10 -> imbalance 1.7.
    # rank 0 contributes its non-last shard of a split document (2 tokens); rank 1 needs exactly those 2.
    m = plan_metrics([0, 0, 1], [0, 2, 0], [2, 2, 4], [0, 1, 1], 2)
    assert (m.imbalance, m.ag_comm_tokens, m.a2a_comm_tokens) == (1.7, 2, 2)


def test_comm_units():
    assert comm_saving(0, 131072, 8) == 1.0
    assert comm_saving(131072 / 8, 131072, 8) == 0.0
    assert kv_bytes_per_token(8, 128, 2) == 4096


@settings(max_examples=300, deadline=None)
@given(random_shards(), st.integers(0, 4))
def test_exchange_volumes_match_naive(case, gpus_per_node):
    shards, cp = case
    doc, start, length, rank = (np.array(c) for c in zip(*shards))
    got = exchange_volumes(doc, start, length, rank, cp, gpus_per_node)
    want = naive_exchange_volumes(shards, cp, gpus_per_node)
    for name, values in want.items():
        assert getattr(got, name).tolist() == values, name
    assert got.ag_slot == max(want["contributed"])
    mask = allgather_shard_mask(doc, start, length, rank, cp)
    assert np.bincount(rank[mask], weights=length[mask], minlength=cp).tolist() == want["contributed"]


@settings(max_examples=400, deadline=None)
@given(random_shards(), st.integers(0, 4), st.sampled_from(["window", "chunk"]), st.integers(1, 14))
def test_exchange_volumes_of_a_layer_kind_match_naive(case, gpus_per_node, kind, size):
    shards, cp = case
    doc, start, length, rank = (np.array(c) for c in zip(*shards))
    got = exchange_volumes(doc, start, length, rank, cp, gpus_per_node, KIND_CODES[kind], size)
    want = naive_exchange_volumes(shards, cp, gpus_per_node, kind, size)
    for name, values in want.items():
        assert getattr(got, name).tolist() == values, (name, kind, size)
    assert kind_local_mask(doc, start, length, rank, cp, KIND_CODES[kind], size).tolist() == \
        naive_local_shards(shards, kind, size)


def test_a_window_longer_than_every_document_moves_what_full_attention_moves():
    for lens, strategy in zip(packed("wlb", 4, 32768, seed=2), ("magi", "flashcp", "magi", "flashcp2")):
        plan = plan_sequence(strategy, lens, 8)
        arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank)
        for per_node in (0, 4):
            full = exchange_volumes(*arrays, 8, per_node)
            wide = exchange_volumes(*arrays, 8, per_node, KIND_CODES["window"], 1 << 20)
            for name in ("sent", "received", "sent_far", "received_far"):
                assert np.array_equal(getattr(full, name), getattr(wide, name)), name
            # the all-gather of a kind leaves out what only a later shard on the same rank reads
            assert (wide.contributed <= full.contributed).all()
            narrow = exchange_volumes(*arrays, 8, per_node, KIND_CODES["window"], 1024)
            assert narrow.received.sum() < full.received.sum()
            assert (narrow.received <= 1023 * (plan.shard_rank[:, None] == np.arange(8)).sum(0)).all()


def test_node_volumes_split_the_exact_need_volumes():
    for lens in packed("wlb", 3, 65536, seed=1):
        plan = plan_sequence("flashcp", lens, 8)
        arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank)
        whole = exchange_volumes(*arrays, 8)
        for per_node in (0, 1, 2, 3, 8):
            v = exchange_volumes(*arrays, 8, per_node)
            assert np.array_equal(v.sent, whole.sent) and np.array_equal(v.received, whole.received)
            assert v.sent_far.sum() == v.received_far.sum()
            if per_node in (0, 8):
                assert v.received_far.sum() == 0
            if per_node == 1:
                assert np.array_equal(v.received_far, v.received)
