"""flashcp+ (flashcp.planner.strategies.flashcp_plus): better balanced than Algorithm 1, the heavy tail whole."""

from flashcp.planner.planning import plan_sequence


def test_flashcp_plus_beats_flashcp_on_a_mixed_sequence():
    lens = [3000, 2500, 2000, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300]
    alg1, plus = (plan_sequence(name, lens, 4).metrics() for name in ("flashcp", "flashcp+"))
    assert alg1.imbalance <= 1.05 and plus.imbalance <= 1.01
    assert plus.ag_comm_tokens < alg1.ag_comm_tokens and plus.a2a_comm_tokens < alg1.a2a_comm_tokens


def test_flashcp_plus_balances_and_keeps_the_tail_whole():
    lens = [30000, 5000, 4000, 3000, 2500, 2000, 1500, 1000, 800, 600, 400, 200, 100]
    plan = plan_sequence("flashcp+", lens, 4)
    assert plan.metrics().imbalance <= 1.01
    last = plan.shard_start[plan.shard_doc == 0].max()
    tail = plan.shard_len[(plan.shard_doc == 0) & (plan.shard_start == last)][0]
    assert tail > 30000 // 8, "the heavy document's tail stays whole on one rank"
