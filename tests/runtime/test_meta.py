"""The per-rank attention meta (flashcp.runtime.meta): comm numbers equal to the cost model, local-only shards,
inactive exchanges, moving to a device once (no process group)."""


import numpy as np
import pytest
import torch

from flashcp.costmodel.comm import allgather_contributions, exact_need_received
from flashcp.costmodel.workload import token_quotas
from flashcp.planner.plan import SequencePlan
from flashcp.runtime import CPAttnMeta, cp_attention
from flashcp.runtime.meta import COLLECTIVE_MODES, build_rank_metas, rank_token_positions
from tests.emulate import random_plan
from tests.naive import naive_document_attention
from tests.naive_meta import assert_same_meta, naive_rank_metas
from tests.plans import llama3_like_plan, plan_builders, whole_docs_case
from tests.runtime import TOL, qkv


def test_meta_comm_numbers_equal_the_cost_model():
    rng = np.random.default_rng(7)
    for trial in range(30):
        cp = int(rng.integers(2, 6))
        doc_lens = rng.integers(1, 20, size=int(rng.integers(1, 8)))
        if doc_lens.sum() < cp:
            continue
        plan = random_plan(doc_lens, cp, rng, max_pieces=int(rng.integers(1, 6)))
        args = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        contributions, received = allgather_contributions(*args), exact_need_received(*args)
        stored = plan.metrics()
        metas = build_rank_metas(plan, doc_lens)
        sent = np.zeros(cp, dtype=np.int64)
        for r, meta in enumerate(metas):
            ag, a2a, full = (meta.exchanges[m] for m in COLLECTIVE_MODES)
            assert ag.num_payload == contributions[r] and ag.send_rows == stored.ag_comm_tokens
            assert ag.wire_recv_tokens == (cp - 1) * stored.ag_comm_tokens
            assert a2a.recv_rows == received[r] == sum(a2a.recv_splits)
            assert a2a.recv_splits[r] == a2a.send_splits[r] == 0, "a rank never sends to itself"
            assert full.send_rows == token_quotas(int(doc_lens.sum()), cp).max()
            assert full.num_payload == meta.num_tokens
            for peer in range(cp):
                assert a2a.send_splits[peer] == metas[peer].exchanges["a2a"].recv_splits[r]
            sent[r] = a2a.wire_send_tokens
            assert meta.auto_comm == metas[0].auto_comm
            assert meta.auto_comm in ("allgather", "a2a"), "auto never picks a baseline (full, ring)"
        assert max(m.exchanges["a2a"].recv_rows for m in metas) == stored.a2a_comm_tokens
        a2a_busiest = max(sent.max(), received.max())
        # bytes per element and step: a2a moves bf16 both ways (2 + 2); the all-gather bf16 forward and a
        # float32 reduce-scatter backward (2 + 4)
        expected_auto = "a2a" if 4 * a2a_busiest < 6 * (cp - 1) * stored.ag_comm_tokens else "allgather"
        assert metas[0].auto_comm == expected_auto


def test_local_only_shards_and_inactive_exchanges():
    doc_lens, plan = whole_docs_case(23, 3, np.random.default_rng(1))
    for meta in build_rank_metas(plan, doc_lens):
        assert bool(meta.shard_local_only.all()) and meta.remote.num_tokens == 0
        assert not meta.exchanges["allgather"].active and not meta.exchanges["a2a"].active
        assert meta.exchanges["full"].active
    # a split document: its first shard's prefix is local, the second needs the first
    plan = llama3_like_plan([8], 2)
    metas = build_rank_metas(plan, [8])
    assert metas[0].shard_local_only.tolist() == [True, False]
    assert metas[1].shard_local_only.tolist() == [False, False]


def test_cp_attention_without_a_process_group_when_nothing_moves():
    doc_lens, plan = whole_docs_case(17, 2, np.random.default_rng(3))
    q, k, v = qkv(17, 4, 2)
    ref = naive_document_attention(q, k, v, doc_lens)
    for rank in range(2):
        meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
        pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
        for comm in ("allgather", "a2a", "auto"):
            out = cp_attention(q[pos], k[pos], v[pos], meta, comm=comm)
            assert (out - ref[pos]).abs().max().item() < TOL


def test_meta_moves_once_and_checks_inputs():
    doc_lens = [5, 4]
    meta = CPAttnMeta.from_plan(llama3_like_plan(doc_lens, 2), doc_lens, 0)
    assert meta.to("cpu") is meta
    assert meta.to("meta") is meta.to("meta") and meta.to("meta").exchanges["a2a"].kv_index.is_meta
    q, k, v = qkv(meta.num_tokens + 1, 4, 2)
    with pytest.raises(ValueError, match="rank 0 holds 5 tokens"):
        cp_attention(q, k, v, meta)
    with pytest.raises(ValueError, match="unknown comm mode 'bogus'"):
        meta.exchange("bogus")
    with pytest.raises(ValueError, match="'ring' moves K/V point-to-point"):
        meta.exchange("ring")
    assert meta.resolve_comm("auto") == meta.auto_comm and meta.resolve_comm("ring") == "ring"


def _random_cases(seed: int, trials: int):
    rng = np.random.default_rng(seed)
    builders = plan_builders()
    names = sorted(builders)
    for trial in range(trials):
        cp = int(rng.integers(1, 10))
        doc_lens = rng.integers(1, int(rng.choice([4, 40, 400])), size=int(rng.integers(1, 12)))
        if doc_lens.sum() < cp:
            continue
        if trial % 3 == 0:
            name = names[trial // 3 % len(names)]
            yield name, doc_lens, builders[name](doc_lens, cp)
        else:
            plan = random_plan(doc_lens, cp, rng, max_pieces=int(rng.integers(1, 6)),
                               cut_prob=float(rng.choice([0.0, 0.05, 0.3])))
            if trial % 2:  # readers accept any row order
                plan = SequencePlan.from_arrays(*(a[::-1] for a in (plan.shard_doc, plan.shard_start,
                                                                   plan.shard_len, plan.shard_rank)), cp)
            yield "random", doc_lens, plan


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_alone_builds_the_meta_the_whole_sequence_maps_give(seed):
    for name, doc_lens, plan in _random_cases(seed, 60):
        expected = naive_rank_metas(plan, doc_lens)
        for rank in range(plan.cp):
            assert_same_meta(CPAttnMeta.from_plan(plan, doc_lens, rank), expected[rank],
                         f"{name} cp={plan.cp} doc_lens={doc_lens.tolist()} rank {rank}")
    for cp in (1, 2, 5):  # whole documents: nothing moves
        doc_lens, plan = whole_docs_case(40, cp, np.random.default_rng(seed))
        for rank, expected in enumerate(naive_rank_metas(plan, doc_lens)):
            assert_same_meta(CPAttnMeta.from_plan(plan, doc_lens, rank), expected, f"whole cp={cp} rank {rank}")
