"""The recurrent layers' cost model against the runtime's layout (RecurrentMeta) and hand-counted plans."""

import numpy as np
import pytest

from flashcp.costmodel.comm import CONTRIBUTED, RECEIVED, RECEIVED_FAR, SENT, SENT_FAR
from flashcp.costmodel.hybrid import NEMOTRON_H_8B, QWEN3_NEXT_80B_A3B, step_bytes
from flashcp.costmodel.recurrent import (
    RecurrentShape,
    conv_volumes_kernel,
    map_volumes_kernel,
    recurrent_contributes,
    recurrent_exchange,
    split_work,
)
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.recurrent import RecurrentMeta
from tests.emulate import random_plan
from tests.naive import naive_recurrent_volumes
from tests.plans import whole_docs_case

GDN = RecurrentShape(kind="gdn", num_heads=4, key_dim=4, value_dim=3, num_groups=2, conv_width=4, num_layers=1)
SSD = RecurrentShape(kind="ssd", num_heads=4, key_dim=5, value_dim=3, num_groups=2, conv_width=4, num_layers=1)
ROWS = {"sent": SENT, "received": RECEIVED, "sent_far": SENT_FAR, "received_far": RECEIVED_FAR,
        "contributed": CONTRIBUTED}


def arrays(plan):
    return plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, plan.cp


def random_plans(cp, count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        doc_lens = rng.integers(1, 40, size=int(rng.integers(1, 8)))
        yield random_plan(doc_lens, cp, rng, max_pieces=int(rng.integers(1, 6)),
                          cut_prob=float(rng.random() * 0.3)), doc_lens


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_contributions_are_the_runtime_meta_s(cp):
    for plan, doc_lens in random_plans(cp, 60, cp):
        contributes = recurrent_contributes(*arrays(plan))
        np.testing.assert_array_equal(map_volumes_kernel(plan.shard_doc, plan.shard_start, plan.shard_rank, cp,
                                                         0)[CONTRIBUTED],
                                      np.bincount(plan.shard_rank[contributes], minlength=cp))
        for rank in range(cp):
            meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
            assert meta.active == bool(contributes.any())
            np.testing.assert_array_equal(meta.contributes, contributes[plan.rank_slice(rank)])


@pytest.mark.parametrize("cp, gpus_per_node", [(2, 0), (3, 2), (4, 0), (4, 2), (8, 4)])
def test_volumes_equal_the_definitions(cp, gpus_per_node):
    """Maps and convolution inputs per rank, their parts between nodes, against a token-by-token recount."""
    for plan, _ in random_plans(cp, 25, 50 + cp):
        shards = list(zip(*(a.tolist() for a in arrays(plan)[:4])))
        for width in (1, 2, 4, 6):
            want = naive_recurrent_volumes(shards, cp, width, gpus_per_node)
            maps = map_volumes_kernel(plan.shard_doc, plan.shard_start, plan.shard_rank, cp, gpus_per_node)
            conv = conv_volumes_kernel(*arrays(plan)[:4], cp, gpus_per_node, width)
            for name, row in ROWS.items():
                assert maps[row].tolist() == want["maps"][name], (name, shards)
                if name != "contributed":
                    assert conv[row].tolist() == want["conv"][name], (name, width, shards)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_runtime_routes_move_what_the_cost_model_counts(cp):
    """Every rank's send and receive splits of both routes sum to the cost model's rows, nothing to itself,
    and what rank a sends rank b is what b expects from a."""
    for plan, doc_lens in random_plans(cp, 30, 70 + cp):
        metas = [RecurrentMeta.from_plan(plan, doc_lens, rank) for rank in range(cp)]
        for width in (2, 4, 6):
            exchange = recurrent_exchange(RecurrentShape(kind="gdn", num_heads=1, key_dim=1, value_dim=1,
                                                         num_groups=1, conv_width=width, num_layers=1), *arrays(plan))
            for table, route_of in ((exchange.maps, lambda m: m.maps), (exchange.conv, lambda m: m.conv_tails(width))):
                routes = [route_of(m) for m in metas]
                send = np.array([r.send_splits for r in routes])
                np.testing.assert_array_equal(send, np.array([r.recv_splits for r in routes]).T)
                assert not np.diag(send).any()
                np.testing.assert_array_equal(send.sum(axis=1), table[SENT])
                np.testing.assert_array_equal(send.sum(axis=0), table[RECEIVED])
                assert all(r.active == bool(send.any()) for r in routes)
                assert all(r.send_index.size == sum(r.send_splits) for r in routes)


def test_a_plan_with_no_cut_document_moves_nothing():
    doc_lens, plan = whole_docs_case(40, 4, np.random.default_rng(0))
    for shape in (GDN, SSD):
        exchange = recurrent_exchange(shape, *arrays(plan))
        assert (exchange.busiest_bytes, exchange.total_bytes) == (0, 0)
        assert not exchange.maps.any() and not exchange.conv.any()
    work = split_work(*arrays(plan))
    assert work.rerun_tokens.sum() == work.mapped_tokens.sum() == 0
    assert work.tokens.sum() == doc_lens.sum()


def test_hand_counted_plan():
    # document 0 (10 tokens) in three pieces on ranks 0, 1, 0; document 1 whole on rank 1; cp 2
    plan = SequencePlan.from_arrays([0, 0, 0, 1], [0, 4, 7, 0], [4, 3, 3, 6], [0, 1, 0, 1], 2)
    assert recurrent_contributes(*arrays(plan)).tolist() == [True, True, False, False]
    exchange = recurrent_exchange(GDN, *arrays(plan))
    assert GDN.map_bytes == 4 * 4 * 4 * (4 + 3) and GDN.conv_channels == 2 * 2 * 4 + 4 * 3
    assert SSD.map_bytes == 4 * 4 * (1 + 3 * 5) and SSD.conv_channels == 4 * 3 + 2 * 2 * 5
    assert GDN.conv_token_bytes == 4 * 28
    # piece 0's map goes to rank 1 (piece 1), piece 1's to rank 0 (piece 2); piece 0's own later piece 2 reads
    # it locally. Conv inputs (W - 1 = 3): rank 1's piece [4, 7) needs tokens 1-3 of rank 0; rank 0's piece
    # [7, 10) needs 4-6, all on rank 1
    assert exchange.maps[SENT].tolist() == [1, 1] and exchange.maps[RECEIVED].tolist() == [1, 1]
    assert exchange.conv[SENT].tolist() == [3, 3] and exchange.conv[RECEIVED].tolist() == [3, 3]
    assert exchange.sent_bytes.tolist() == [GDN.map_bytes + 3 * 4 * 28] * 2
    assert exchange.total_bytes == 2 * (GDN.map_bytes + 3 * 4 * 28)
    assert exchange.busiest_bytes == exchange.total_bytes // 2
    work = split_work(*arrays(plan))
    assert work.tokens.tolist() == [7, 9] and work.rerun_tokens.tolist() == [0, 3]
    assert work.mapped_tokens.tolist() == [4, 3]
    np.testing.assert_allclose(work.extra_tokens(GDN), [4 * 4 / 3, 3 + 3 * 4 / 3])
    np.testing.assert_allclose(work.extra_tokens(SSD), [0, 3])


def test_maps_go_to_each_later_rank_once_and_inputs_as_far_as_they_reach():
    # one document in five pieces of 2 tokens on ranks 0, 1, 2, 1, 3 (cp 4): piece 0 -> {1, 2, 3}, piece 1 ->
    # {2, 3}, piece 2 -> {1, 3}, piece 3 -> {3}; the last piece maps nothing
    plan = SequencePlan.from_arrays([0] * 5, [0, 2, 4, 6, 8], [2] * 5, [0, 1, 2, 1, 3], 4)
    exchange = recurrent_exchange(GDN, *arrays(plan))
    assert exchange.maps[SENT].tolist() == [3, 3, 2, 0] and exchange.maps[RECEIVED].tolist() == [0, 2, 2, 4]
    assert exchange.maps[CONTRIBUTED].tolist() == [1, 2, 1, 0]
    # W - 1 = 3 inputs before each piece: rank 1's piece at 2 needs tokens 0-1 (rank 0), its piece at 6 needs 3
    # (its own) and 4-5 (rank 2); rank 2's piece at 4 needs 1 (rank 0) and 2-3 (rank 1); rank 3's piece at 8
    # needs 5 (rank 2) and 6-7 (rank 1)
    assert exchange.conv[SENT].tolist() == [3, 4, 3, 0] and exchange.conv[RECEIVED].tolist() == [0, 4, 3, 3]
    # two nodes of two ranks
    with_nodes = recurrent_exchange(GDN, *arrays(plan), gpus_per_node=2)
    assert with_nodes.maps[SENT_FAR].tolist() == [2, 3, 1, 0] and with_nodes.maps[RECEIVED_FAR].tolist() == [0, 1, 2, 3]


def test_step_bytes_of_a_hybrid_against_its_all_attention_twin():
    plan = SequencePlan.from_arrays([0, 0, 1], [0, 5, 0], [5, 5, 10], [0, 1, 0], 2)
    model = QWEN3_NEXT_80B_A3B
    got = step_bytes(model, *arrays(plan))
    kv_row = 2 * 2 * 256 * 2
    # rank 1 needs document 0's first 5 tokens: 5 rows forward, 5 back; per layer one map and 3 conv input
    # tokens go from rank 0 to rank 1 each way (rank 1 sends nothing forward)
    rec = 2 * 36 * (model.recurrent.map_bytes + 3 * model.recurrent.conv_token_bytes)
    assert got.attention_total == 2 * 48 * 5 * kv_row and got.attention_busiest == got.attention_total
    assert got.recurrent_total == rec
    assert got.hybrid_total == 2 * 12 * 5 * kv_row + rec
    assert got.hybrid_busiest == got.hybrid_total  # rank 0 sends all of it
    assert model.recurrent.map_bytes == 4 * 32 * 128 * 256 and model.recurrent.conv_token_bytes == 4 * 8192
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
