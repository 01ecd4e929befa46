"""The step-time objective (flashcp.costmodel.objective): equal to the bench's projection, its pruning bound
and its per-shard re-pricing (the equality over shapes, dtypes and token slack is in test_projection.py)."""

import numpy as np
import pytest

from flashcp.costmodel.objective import cached_model, plan_step_seconds, sequence_flops
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.shape import AttentionShape
from flashcp.planner.planning import plan_sequence
from tests.naive import naive_sequence_flops

MODEL = cached_model(None, 32, 32, 128, 1)
SHAPE = AttentionShape(num_heads=32, num_kv_heads=32, head_dim=128)


def test_objective_equals_bench_projection():
    profile = load_profile()
    rng = np.random.default_rng(5)
    for _ in range(25):
        lens = rng.integers(1, 30000, rng.integers(1, 25))
        cp = int(rng.integers(1, 17))
        for name in ("flashcp", "flashcp+", "llama3", "perdoc", "magi"):
            plan = plan_sequence(name, lens, cp)
            expected = project_step(plan, SHAPE, profile, "auto", True).total
            assert plan_step_seconds(plan, MODEL) == pytest.approx(expected, rel=1e-12)

def test_rank_floor_bounds_and_cached_shard_seconds_agree():
    """``rank_floor`` (the portfolio's pruning bound) never exceeds the step time, and the step time from
    per-shard seconds (what the local search re-prices move by move) is the step time, bit for bit."""
    from flashcp.costmodel.objective import rank_floor, shard_seconds, step_seconds, step_seconds_of

    rng = np.random.default_rng(9)
    wide = cached_model(None, 32, 8, 128, 3, True)  # GQA, 3 layers, per-token layers priced
    tight = 0
    for _ in range(30):
        lens = rng.integers(1, 20000, rng.integers(1, 30))
        cp = int(rng.integers(1, 17))
        for name in ("flashcp", "flashcp+", "llama3", "magi", "flashcp2"):
            plan = plan_sequence(name, lens, cp)
            arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
            for model in (MODEL, wide):
                total = step_seconds(*arrays, model)
                assert step_seconds_of(*arrays, model, *shard_seconds(plan.shard_start, plan.shard_len, model),
                                       -1) == total
                floors = [rank_floor(*arrays, model, r) for r in range(cp)]
                assert max(floors) <= total, (name, cp, max(floors), total)
                tight += max(floors) >= 0.9 * total
    assert tight > 0, "the floor never came close to the step time"

def test_objective_with_topology_equals_projection():
    profile = load_profile()
    rng = np.random.default_rng(11)
    for _ in range(12):
        lens = rng.integers(1, 30000, rng.integers(1, 25))
        cp = int(rng.choice([4, 8, 12, 16]))
        for per_node in (2, 4, 8):
            model = cached_model(None, 32, 32, 128, 1, False, per_node)
            for name in ("flashcp", "flashcp+", "llama3", "magi"):
                plan = plan_sequence(name, lens, cp)
                expected = project_step(plan, SHAPE, profile, "auto", True, gpus_per_node=per_node).total
                assert plan_step_seconds(plan, model) == pytest.approx(expected, rel=1e-12)
                assert expected >= project_step(plan, SHAPE, profile, "auto", True).total
    # one node: as before
    plan = plan_sequence("flashcp", [9000, 5000, 3000], 4)
    assert project_step(plan, SHAPE, profile, "auto", True, gpus_per_node=4).total == \
        project_step(plan, SHAPE, profile, "auto", True).total


def test_sequence_flops_counts_every_token_and_pair():
    rng = np.random.default_rng(5)
    shapes = [AttentionShape(), AttentionShape(num_heads=8, num_kv_heads=2, head_dim=64, layers=3)]
    for shape in shapes:
        rows = [rng.integers(1, 300, size=int(rng.integers(1, 6))) for _ in range(7)]
        offsets = np.r_[0, np.cumsum([r.size for r in rows])]
        got = sequence_flops(offsets, np.concatenate(rows), shape)
        expected = [naive_sequence_flops(r.tolist(), shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                         shape.layers, shape.hidden_mult) for r in rows]
        assert got.dtype == np.float64 and np.allclose(got, expected, rtol=1e-12, atol=0), (got, expected)


def test_a_plans_shape_comes_from_its_parameters():
    assert AttentionShape.from_params({}) == AttentionShape()
    shape = AttentionShape.from_params({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "layers": 4,
                                        "target_imbalance": 1.05})
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.layers) == (8, 2, 64, 4)
