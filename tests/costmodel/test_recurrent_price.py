"""The recurrent layers' price (a hybrid's ``AttentionShape.recurrent``): the Numba objective equals the bench's
projection, a plan cutting no document exchanges nothing, and flashcp2 planned for the hybrid is never slower
under its price than plans made for its attention layers alone or the peers."""

import numpy as np
import pytest

from flashcp.costmodel.hybrid import NEMOTRON_H_8B, QWEN3_NEXT_80B_A3B
from flashcp.costmodel.objective import (
    model_vector,
    plan_step_seconds,
    rank_floor,
    recurrent_exchange_seconds,
    recurrent_seconds,
    shard_seconds,
    step_seconds,
    step_seconds_of,
)
from flashcp.costmodel.profile import load_profile
from flashcp.costmodel.projection import project_step, recurrent_step_seconds
from flashcp.costmodel.recurrent import split_work
from flashcp.costmodel.shape import AttentionShape
from flashcp.planner.params import resolve_params
from flashcp.planner.plan import SequencePlan
from flashcp.planner.planning import plan_flat, plan_sequence
from flashcp.planner.registry import get_strategy
from tests.emulate import random_plan
from tests.naive import naive_recurrent_volumes

QWEN = AttentionShape(num_heads=16, num_kv_heads=2, head_dim=256, layers=12, recurrent=QWEN3_NEXT_80B_A3B.recurrent)
NEMOTRON = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, layers=4, recurrent=NEMOTRON_H_8B.recurrent)
HYBRIDS = [QWEN, NEMOTRON,
           AttentionShape(num_heads=16, num_kv_heads=2, head_dim=256, layers=4, recurrent=QWEN3_NEXT_80B_A3B.recurrent,
                          layer_kinds=(("window", 2048, 3), ("full", 0, 1)))]


@pytest.mark.parametrize("shape", HYBRIDS, ids=["qwen3-next", "nemotron-h", "windowed"])
def test_objective_equals_projection_for_hybrids(shape):
    """One node and two nodes of 4 ranks; the per-shard re-pricing and the pruning bound hold too."""
    profile = load_profile()
    rng = np.random.default_rng(41)
    for per_node in (0, 4):
        model = model_vector(profile, shape, gpus_per_node=per_node)
        for _ in range(5):
            lens = rng.integers(1, 30000, rng.integers(1, 25))
            cp = int(rng.choice([4, 8]))
            for name in ("flashcp", "flashcp+", "llama3", "magi"):
                plan = plan_sequence(name, lens, cp)
                got = project_step(plan, shape, profile, "auto", True, gpus_per_node=per_node)
                assert got.recurrent > 0
                assert plan_step_seconds(plan, model) == pytest.approx(got.total * shape.layers, rel=1e-12)
                arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
                total = step_seconds(*arrays, model)
                assert step_seconds_of(*arrays, model, *shard_seconds(plan.shard_start, plan.shard_len, model),
                                       -1) == total
                assert max(rank_floor(*arrays, model, r) for r in range(cp)) <= total


def test_recurrent_price_by_hand():
    """Two documents on 2 ranks, priced from the formula: the uncut plan pays its tokens only, the cut one
    its extra split work (GDN: the mapped piece's K / V value columns) and, each pass, one state map and the
    3 convolution inputs before the second piece, each all-to-all with its latency."""
    profile = load_profile()
    rec = QWEN3_NEXT_80B_A3B.recurrent
    per_token = rec.flops_per_token / (profile.peak_tflops * 1e12)
    whole = SequencePlan(shard_doc=np.array([0, 1]), shard_start=np.array([0, 0]), shard_len=np.array([100, 60]),
                         shard_rank=np.array([0, 1]), cp=2)
    cut = SequencePlan(shard_doc=np.array([0, 0, 1]), shard_start=np.array([0, 50, 0]),
                       shard_len=np.array([50, 50, 60]), shard_rank=np.array([0, 1, 0]), cp=2)
    latency = profile.collective_latency_us * 1e-6
    exchange = (rec.map_bytes / (profile.link_gbps * 1e9) + latency) \
        + (3 * rec.conv_token_bytes / (profile.link_gbps * 1e9) + latency)
    want = {id(whole): 36 * 3 * 100 * per_token,
            id(cut): 36 * (3 * (110 + 50 * rec.key_dim / rec.value_dim) * per_token + 2 * exchange)}
    for plan in (whole, cut):
        model = model_vector(profile, QWEN, gpus_per_node=0)
        arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp)
        assert recurrent_step_seconds(plan, QWEN, profile, 0) == pytest.approx(want[id(plan)], rel=1e-12)
        assert recurrent_seconds(*arrays, model, -1) == pytest.approx(want[id(plan)], rel=1e-12)


def naive_exchange_seconds(shards, cp, rec, profile, gpus_per_node):
    """One pass of a recurrent layer's two all-to-alls, from ``naive_recurrent_volumes``: per all-to-all the
    busiest rank's rows inside its node at the node link and between nodes at the inter-node link, at once,
    plus the latency; nothing when no row moves."""
    volumes = naive_recurrent_volumes(shards, cp, rec.conv_width, gpus_per_node)
    seconds = 0.0
    for name, row_bytes in (("maps", rec.map_bytes), ("conv", rec.conv_token_bytes)):
        v = volumes[name]
        near = max(max(v["sent"][r] - v["sent_far"][r], v["received"][r] - v["received_far"][r]) for r in range(cp))
        far = max(max(v["sent_far"][r], v["received_far"][r]) for r in range(cp))
        if near or far:
            seconds += max(near * row_bytes / (profile.link_gbps * 1e9),
                           far * row_bytes / (profile.inter_node_gbps * 1e9)) + profile.collective_latency_us * 1e-6
    return seconds


@pytest.mark.parametrize("shape", [QWEN, NEMOTRON], ids=["qwen3-next", "nemotron-h"])
@pytest.mark.parametrize("per_node", [0, 2])
def test_exchange_seconds_kernel_equals_a_plain_recount(shape, per_node):
    """The Numba kernel's exchange time against a plain-Python recount of the rows, on random plans."""
    profile = load_profile()
    model = model_vector(profile, shape, gpus_per_node=per_node)
    rng = np.random.default_rng(53)
    for _ in range(20):
        lens = rng.integers(1, 40, rng.integers(1, 7))
        cp = int(rng.choice([2, 3, 4]))
        plan = random_plan(lens, cp, rng, max_pieces=4, cut_prob=0.2)
        arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        shards = list(zip(*(a.tolist() for a in arrays[:4])))
        want = naive_exchange_seconds(shards, cp, shape.recurrent, profile, per_node)
        assert recurrent_exchange_seconds(*arrays, model) == pytest.approx(want, rel=1e-12, abs=0.0)


def test_a_plan_cutting_no_document_exchanges_nothing():
    """Every document whole on one rank: the recurrent price is the slowest rank's recurrence, no collective."""
    profile = load_profile()
    rng = np.random.default_rng(43)
    for shape in (QWEN, NEMOTRON):
        per_token = shape.recurrent.flops_per_token / (profile.peak_tflops * 1e12)
        for _ in range(5):
            lens = rng.integers(1, 5000, 12)
            cp = 4
            plan = SequencePlan(shard_doc=np.arange(12), shard_start=np.zeros(12, np.int64), shard_len=lens,
                                shard_rank=np.arange(12) % cp, cp=cp)
            work = split_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
            assert not work.rerun_tokens.any() and not work.mapped_tokens.any()
            want = shape.recurrent.num_layers * 3 * float(work.tokens.max()) * per_token
            arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
            for per_node in (0, 2):
                assert recurrent_step_seconds(plan, shape, profile, per_node) == pytest.approx(want, rel=1e-12)
                model = model_vector(profile, shape, gpus_per_node=per_node)
                assert recurrent_seconds(*arrays, model, -1) == pytest.approx(want, rel=1e-12)


def test_shape_round_trips_its_recurrent_layers():
    for shape in HYBRIDS:
        again = AttentionShape.from_params(shape.as_dict())
        assert again == shape and again.recurrent == shape.recurrent
    assert AttentionShape().as_dict()["recurrent"] is None


def _flashcp2(lens, cp, shape):
    strategy = get_strategy("flashcp2")
    _, doc, start, length, rank = plan_flat(strategy, np.array([0, lens.size], np.int64), lens, cp,
                                            resolve_params(strategy), shape=shape)
    return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


@pytest.mark.parametrize("hybrid", [QWEN, NEMOTRON], ids=["qwen3-next", "nemotron-h"])
def test_flashcp2_planned_for_the_hybrid_is_never_slower_for_it(hybrid):
    """Under the hybrid's price, flashcp2's plan for the hybrid beats (or ties) its plan for the attention
    layers alone and every peer's default plan."""
    profile = load_profile()
    attention_only = AttentionShape(num_heads=hybrid.num_heads, num_kv_heads=hybrid.num_kv_heads,
                                    head_dim=hybrid.head_dim, layers=hybrid.layers)
    rng = np.random.default_rng(47)
    for _ in range(4):
        lens = rng.integers(1, 40000, rng.integers(2, 20))
        cp = int(rng.choice([4, 8]))

        def price(plan):
            return project_step(plan, hybrid, profile, "auto", True).total

        mine = price(_flashcp2(lens, cp, hybrid))
        assert mine <= price(_flashcp2(lens, cp, attention_only)) * (1 + 1e-12)
        for peer in ("flashcp+", "magi", "flashcp", "llama3", "ptrr"):
            assert mine <= price(plan_sequence(peer, lens, cp)) * (1 + 1e-12)
