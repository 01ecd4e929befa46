"""The recurrent layers' cost model against the runtime's layout (RecurrentMeta) and hand-counted plans."""

import numpy as np
import pytest

from flashcp.costmodel.hybrid import NEMOTRON_H_8B, QWEN3_NEXT_80B_A3B, step_bytes
from flashcp.costmodel.recurrent import (
    RecurrentShape,
    recurrent_contributes,
    recurrent_exchange,
    recurrent_needed_maps,
    split_work,
)
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.recurrent import RecurrentMeta
from tests.emulate import random_plan
from tests.plans import whole_docs_case

GDN = RecurrentShape(kind="gdn", num_heads=4, key_dim=4, value_dim=3, num_groups=2, conv_width=4, num_layers=1)
SSD = RecurrentShape(kind="ssd", num_heads=4, key_dim=5, value_dim=3, num_groups=2, conv_width=4, num_layers=1)


def arrays(plan):
    return plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_contributions_and_slot_are_the_runtime_meta_s(cp):
    rng = np.random.default_rng(cp)
    for _ in range(60):
        doc_lens = rng.integers(1, 40, size=int(rng.integers(1, 8)))
        plan = random_plan(doc_lens, cp, rng, max_pieces=int(rng.integers(1, 6)), cut_prob=float(rng.random() * 0.3))
        contributes, slot = recurrent_contributes(*arrays(plan))
        for rank in range(cp):
            meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
            assert meta.slot == slot
            np.testing.assert_array_equal(meta.contributes, contributes[plan.rank_slice(rank)])


def test_a_plan_with_no_cut_document_moves_nothing():
    doc_lens, plan = whole_docs_case(40, 4, np.random.default_rng(0))
    for shape in (GDN, SSD):
        exchange = recurrent_exchange(shape, *arrays(plan))
        assert (exchange.slot, exchange.busiest_bytes, exchange.total_bytes) == (0, 0, 0)
    work = split_work(*arrays(plan))
    assert work.rerun_tokens.sum() == work.mapped_tokens.sum() == 0
    assert work.tokens.sum() == doc_lens.sum()


def test_hand_counted_plan():
    # document 0 (10 tokens) in three pieces on ranks 0, 1, 0; document 1 whole on rank 1; cp 2
    plan = SequencePlan.from_arrays([0, 0, 0, 1], [0, 4, 7, 0], [4, 3, 3, 6], [0, 1, 0, 1], 2)
    contributes, slot = recurrent_contributes(*arrays(plan))
    assert contributes.tolist() == [True, True, False, False] and slot == 1
    exchange = recurrent_exchange(GDN, *arrays(plan))
    assert GDN.map_bytes == 4 * 4 * 4 * (4 + 3) and GDN.conv_channels == 2 * 2 * 4 + 4 * 3
    assert SSD.map_bytes == 4 * 4 * (1 + 3 * 5) and SSD.conv_channels == 4 * 3 + 2 * 2 * 5
    assert exchange.map_bytes_per_rank == GDN.map_bytes and exchange.tail_bytes_per_rank == 4 * 3 * 28
    assert exchange.total_bytes == 2 * (GDN.map_bytes + 4 * 3 * 28)
    work = split_work(*arrays(plan))
    assert work.tokens.tolist() == [7, 9] and work.rerun_tokens.tolist() == [0, 3]
    assert work.mapped_tokens.tolist() == [4, 3]
    np.testing.assert_allclose(work.extra_tokens(GDN), [4 * 4 / 3, 3 + 3 * 4 / 3])
    np.testing.assert_allclose(work.extra_tokens(SSD), [0, 3])
    # piece 0's map is used on rank 1 (piece 1); piece 1's on rank 0 (piece 2)
    assert [a.tolist() for a in recurrent_needed_maps(*arrays(plan))] == [[1, 1], [1, 1]]


def test_needed_maps_go_to_each_later_rank_once():
    # one document in five pieces on ranks 0, 1, 2, 1, 3 (cp 4): piece 0 -> {1, 2, 3}, piece 1 -> {2, 3},
    # piece 2 -> {1, 3}, piece 3 -> {3}; the last piece contributes nothing
    plan = SequencePlan.from_arrays([0] * 5, [0, 2, 4, 6, 8], [2] * 5, [0, 1, 2, 1, 3], 4)
    sent, received = recurrent_needed_maps(*arrays(plan))
    assert sent.tolist() == [3, 3, 2, 0] and received.tolist() == [0, 2, 2, 4]
    assert recurrent_contributes(*arrays(plan))[1] == 2  # rank 1 contributes two pieces: every rank sends two


def test_step_bytes_of_a_hybrid_against_its_all_attention_twin():
    plan = SequencePlan.from_arrays([0, 0, 1], [0, 5, 0], [5, 5, 10], [0, 1, 0], 2)
    model = QWEN3_NEXT_80B_A3B
    got = step_bytes(model, *arrays(plan))
    kv_row = 2 * 2 * 256 * 2
    # rank 1 needs document 0's first 5 tokens: 5 rows forward, 5 back; one map and one tail per layer each way
    rec = 2 * 2 * 36 * (model.recurrent.map_bytes + model.recurrent.tail_bytes)
    assert got.attention_total == 2 * 48 * 5 * kv_row and got.attention_busiest == got.attention_total
    assert got.recurrent_total == rec
    assert got.recurrent_needed_total == 2 * 36 * model.recurrent.map_bytes
    assert got.hybrid_total == 2 * 12 * 5 * kv_row + rec
    assert got.hybrid_busiest == 2 * 12 * 5 * kv_row + rec // 2
    assert model.recurrent.map_bytes == 4 * 32 * 128 * 256 and model.recurrent.tail_bytes == 4 * 3 * 8192
    assert NEMOTRON_H_8B.recurrent.map_bytes == 4 * 128 * (1 + 64 * 128)


def test_shapes_are_the_installed_transformers_configs():
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen3NextConfig()
    gdn = QWEN3_NEXT_80B_A3B.recurrent
    assert (gdn.num_heads, gdn.key_dim, gdn.value_dim, gdn.num_groups, gdn.conv_width) == (
        qwen.linear_num_value_heads, qwen.linear_key_head_dim, qwen.linear_value_head_dim,
        qwen.linear_num_key_heads, qwen.linear_conv_kernel_dim)
    assert gdn.num_layers == qwen.layer_types.count("linear_attention")
    assert QWEN3_NEXT_80B_A3B.num_attention_layers == qwen.layer_types.count("full_attention")
    assert (QWEN3_NEXT_80B_A3B.num_kv_heads, QWEN3_NEXT_80B_A3B.head_dim) == (qwen.num_key_value_heads, qwen.head_dim)
    nemotron = transformers.NemotronHConfig()
    ssd = NEMOTRON_H_8B.recurrent
    assert (ssd.num_heads, ssd.key_dim, ssd.value_dim, ssd.num_groups, ssd.conv_width) == (
        nemotron.mamba_num_heads, nemotron.ssm_state_size, nemotron.mamba_head_dim, nemotron.n_groups,
        nemotron.conv_kernel)
    assert (NEMOTRON_H_8B.num_kv_heads, NEMOTRON_H_8B.head_dim) == (nemotron.num_key_value_heads, nemotron.head_dim)


@pytest.mark.parametrize("bad", [dict(kind="rnn"), dict(num_heads=0), dict(conv_width=0), dict(num_layers=-1)])
def test_shape_refuses_bad_fields(bad):
    fields = dict(kind="gdn", num_heads=1, key_dim=1, value_dim=1, num_groups=1, conv_width=1, num_layers=1) | bad
    with pytest.raises(ValueError):
        RecurrentShape(**fields)
