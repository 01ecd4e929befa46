"""The step-time objective (flashcp.costmodel.objective): equal to the bench's projection, its pruning bound
and its per-shard re-pricing (the equality over shapes, dtypes and token slack is in test_projection.py)."""

import numpy as np
import pytest

from flashcp.costmodel.objective import cached_model, plan_step_seconds, sequence_flops
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.recurrent import RecurrentShape
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


def test_sequence_flops_prices_each_layer_kind_and_the_recurrent_layers():
    """What a DP step balances: a windowed, chunked or hybrid model's sequences priced for their own layers."""
    rng = np.random.default_rng(9)
    recurrent = RecurrentShape(kind="gdn", num_heads=4, key_dim=16, value_dim=32, num_groups=2, conv_width=4,
                               num_layers=3)
    for shape in [*KIND_SHAPES, AttentionShape(num_heads=8, num_kv_heads=2, head_dim=64, layers=1,
                                               recurrent=recurrent)]:
        rows = [rng.integers(1, 3000, size=int(rng.integers(1, 5))) for _ in range(5)]
        offsets = np.r_[0, np.cumsum([r.size for r in rows])]
        got = sequence_flops(offsets, np.concatenate(rows), shape)
        kinds = [(kind, size) for kind, size, count in shape.layer_kinds for _ in range(count)] or None
        rec = shape.recurrent
        expected = [naive_sequence_flops(r.tolist(), shape.num_heads, shape.num_kv_heads, shape.head_dim,
                                         shape.layers, shape.hidden_mult, kinds, rec.num_layers if rec else 0,
                                         rec.flops_per_token if rec else 0.0) for r in rows]
        assert np.allclose(got, expected, rtol=1e-12, atol=0), (shape, got, expected)
    # a window of 1,024 prices a 100K document's attention far below full causal: the DP order changes with it
    windowed = KIND_SHAPES[0]
    full = AttentionShape(num_heads=windowed.num_heads, num_kv_heads=windowed.num_kv_heads,
                          head_dim=windowed.head_dim, layers=windowed.layers)
    assert sequence_flops([0, 1], [100_000], windowed)[0] < sequence_flops([0, 1], [100_000], full)[0] / 2


def test_a_plans_shape_comes_from_its_parameters():
    assert AttentionShape.from_params({}) == AttentionShape()
    shape = AttentionShape.from_params({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "layers": 4,
                                        "target_imbalance": 1.05})
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.layers) == (8, 2, 64, 4)


KIND_SHAPES = [
    AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, layers=4, layer_kinds=(("window", 4096, 4),)),
    AttentionShape(num_heads=16, num_kv_heads=8, head_dim=256, layers=6,
                   layer_kinds=(("window", 1024, 5), ("full", 0, 1))),
    AttentionShape(num_heads=64, num_kv_heads=8, head_dim=64, layers=4,
                   layer_kinds=(("window", 128, 1), ("full", 0, 1), ("window", 128, 1), ("full", 0, 1))),
    AttentionShape(num_heads=40, num_kv_heads=8, head_dim=128, layers=4,
                   layer_kinds=(("chunk", 8192, 3), ("full", 0, 1))),
    AttentionShape(num_heads=8, num_kv_heads=2, head_dim=64, layers=3, layer_kinds=(("chunk", 700, 2),
                                                                                      ("window", 333, 1))),
]


@pytest.mark.parametrize("shape", KIND_SHAPES, ids=lambda s: "+".join(f"{k}{z}x{c}" for k, z, c in s.layer_kinds))
def test_objective_equals_projection_for_every_layer_kind(shape):
    """Per kind: its pairs, its exchange, its ``auto`` choice and local part, counted once per layer of it."""
    from flashcp.costmodel.objective import model_vector, rank_floor, shard_seconds, step_seconds, step_seconds_of

    profile = load_profile()
    rng = np.random.default_rng(17)
    for per_node in (0, 4):
        model = model_vector(profile, shape, gpus_per_node=per_node)
        for _ in range(6):
            lens = rng.integers(1, 30000, rng.integers(1, 25))
            cp = int(rng.choice([4, 8, 12]))
            for name in ("flashcp", "flashcp+", "llama3", "magi"):
                plan = plan_sequence(name, lens, cp)
                expected = project_step(plan, shape, profile, "auto", True, gpus_per_node=per_node).total
                assert plan_step_seconds(plan, model) == pytest.approx(expected * shape.layers, rel=1e-12)
                arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
                total = step_seconds(*arrays, model)
                assert step_seconds_of(*arrays, model, *shard_seconds(plan.shard_start, plan.shard_len, model),
                                       -1) == total
                assert max(rank_floor(*arrays, model, r) for r in range(cp)) <= total


def test_a_window_past_every_document_prices_as_full_attention():
    """The window path (its own local part, keys and exchange) meets the full-attention path where they
    must agree: a window longer than every document; a narrower one is cheaper."""
    profile = load_profile()
    rng = np.random.default_rng(23)
    full = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, layers=2)
    wide = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, layers=2, layer_kinds=(("window", 1 << 20, 2),))
    narrow = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, layers=2, layer_kinds=(("window", 512, 2),))
    for _ in range(8):
        lens = rng.integers(1, 30000, rng.integers(1, 20))
        cp = int(rng.choice([4, 8]))
        for name in ("flashcp", "magi", "llama3"):
            plan = plan_sequence(name, lens, cp)
            for per_node in (0, 2):
                got = project_step(plan, wide, profile, "auto", True, gpus_per_node=per_node)
                want = project_step(plan, full, profile, "auto", True, gpus_per_node=per_node)
                assert got == want
                assert project_step(plan, narrow, profile, "auto", True, gpus_per_node=per_node).total < want.total
