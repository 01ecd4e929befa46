"""Rank placement on nodes (flashcp.planner.strategies.topology): equal to the reference, the plan kept,
cross-node rows cut."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from flashcp.costmodel.comm import exact_need_received, exchange_volumes
from flashcp.planner.plan import SequencePlan
from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies import flashcp2 as _search
from flashcp.planner.strategies import topology as _topology
from tests.naive import (
    naive_relabel,
    naive_traffic,
)
from tests.plans import as_tuples, examples, packed, sequences


@examples(40)
@given(case=sequences(max_docs=12, max_len=3000, max_cp=12), per_node=st.integers(1, 6))
def test_relabel_equals_reference_and_keeps_the_plan(case, per_node):
    lens, cp = case
    plan = plan_sequence("flashcp+", lens, cp)
    shards = as_tuples(plan)
    traffic = _topology.traffic_matrix(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    assert traffic.tolist() == naive_traffic(shards, cp)
    placed = _search.on_nodes(np.asarray(lens, np.int64), plan.shard_doc, plan.shard_start, plan.shard_len,
                               plan.shard_rank, cp, per_node)
    got = list(zip(*(a.tolist() for a in placed)))
    assert got == naive_relabel(shards, cp, per_node)
    relabelled = SequencePlan.from_arrays(*placed, cp=cp)
    relabelled.validate(lens)
    # a relabelling: same workloads, tokens and exact-need volumes, only on other ranks
    assert relabelled.metrics().imbalance == plan.metrics().imbalance
    assert sorted(exact_need_received(*placed, cp)) == sorted(exact_need_received(
        plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp))


def test_relabel_cuts_cross_node_rows():
    cuts = 0
    for lens in packed("prolong", 6, 131072, seed=4):
        plan = plan_sequence("flashcp+", lens, 16)
        before = exchange_volumes(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, 16, 8)
        placed = _search.on_nodes(lens, plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, 16, 8)
        after = exchange_volumes(*placed, 16, 8)
        peak = (max(before.sent_far.max(), before.received_far.max()),
                max(after.sent_far.max(), after.received_far.max()))
        assert peak[1] <= peak[0]
        cuts += peak[1] < peak[0]
    assert cuts > 0, "no plan's cross-node rows dropped"
