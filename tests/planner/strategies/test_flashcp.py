"""Algorithm 1 (flashcp.planner.strategies.flashcp) on sequences whose plans are known by hand."""

from flashcp.costmodel.comm import PlanMetrics
from flashcp.planner.planning import plan_sequence


def test_flashcp_keeps_documents_whole_when_they_balance():
    plan = plan_sequence("flashcp", [1000] * 8 + [500] * 8, 4)
    assert plan.num_shards == 16, "every document whole on one rank"
    assert plan.metrics() == PlanMetrics(imbalance=1.0, ag_comm_tokens=0, a2a_comm_tokens=0)


def test_flashcp_perdoc_fallback_for_one_dominant_document():
    lens = [60000, 100, 200, 300]
    plan = plan_sequence("flashcp", lens, 4)
    assert set(plan.shard_rank[plan.shard_doc == 0].tolist()) == {0, 1, 2, 3}
    assert plan.metrics().imbalance <= 1.05
