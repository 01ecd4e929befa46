"""Single-process runtime checks: kernels, meta construction and an emulated exchange (no process group)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel.comm import allgather_contributions, exact_need_received
from flashcp.costmodel.workload import token_quotas
from flashcp.runtime import CPAttnMeta, cp_attention
from flashcp.runtime.emulate import emulate_cp_attention, random_plan
from flashcp.runtime.kernels import BackendUnavailableError, resolve_backend, varlen_attention
from flashcp.runtime.meta import COLLECTIVE_MODES, COMM_MODES, build_rank_metas, rank_token_positions
from tests.naive import naive_document_attention
from tests.plans import llama3_like_plan, perdoc_like_plan, whole_docs_case

TOL = 1e-10


def qkv(context_len, num_heads, num_kv_heads, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        return torch.randn(context_len, h, head_dim, dtype=torch.float64, generator=gen, requires_grad=True)

    return rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)


def max_errors(out, ref, inputs, grad_out, ref_grads):
    got = torch.autograd.grad(out, inputs, grad_out)
    return [(out - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(got, ref_grads)]


def check_plan(plan, doc_lens, num_heads=4, num_kv_heads=2, seed=0, comms=COMM_MODES + ("auto",)):
    q, k, v = qkv(int(np.sum(doc_lens)), num_heads, num_kv_heads, seed=seed)
    ref = naive_document_attention(q, k, v, doc_lens)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for comm in comms:
        out = emulate_cp_attention(q, k, v, plan, doc_lens, comm, "reference")
        errors = max_errors(out, ref.detach(), (q, k, v), grad_out, ref_grads)
        assert max(errors) < TOL, f"{comm}: max |err| of out, dq, dk, dv = {errors}"


def test_reference_kernel_is_bottom_right_causal():
    # one query shard [3, 5) of a 5-token document: its rows of full causal attention over keys [0, 5)
    q, k, v = qkv(5, 4, 2)
    full = naive_document_attention(q, k, v, [5])
    out = varlen_attention(q[3:], k, v, torch.tensor([0, 2], dtype=torch.int32),
                           torch.tensor([0, 5], dtype=torch.int32), 2, 5, "reference")
    assert (out - full[3:]).abs().max().item() < TOL


def test_backend_resolution_on_cpu():
    q = torch.zeros(2, 2, 4)
    assert resolve_backend("auto", q) == "reference"
    for backend in ("flash_attn", "torch_varlen"):
        with pytest.raises(BackendUnavailableError, match=f"'{backend}' cannot run here: .*CUDA"):
            resolve_backend(backend, q)
    with pytest.raises(BackendUnavailableError, match="unknown backend 'flash'"):
        resolve_backend("flash", q)


@st.composite
def random_cases(draw):
    cp = draw(st.integers(1, 4))
    doc_lens = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    if sum(doc_lens) < cp:
        doc_lens.append(cp)
    seed = draw(st.integers(0, 2**32 - 1))
    max_pieces = draw(st.sampled_from([1, 2, 4, 1000]))
    plan = random_plan(doc_lens, cp, np.random.default_rng(seed), max_pieces=max_pieces, cut_prob=0.2)
    return plan, doc_lens, draw(st.sampled_from([(4, 4), (4, 2), (4, 1)]))


@settings(max_examples=40, deadline=None)
@given(random_cases())
def test_emulated_random_plans_match_dense_reference(case):
    plan, doc_lens, (num_heads, num_kv_heads) = case
    check_plan(plan, doc_lens, num_heads, num_kv_heads)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_emulated_baseline_plans_match_dense_reference(cp):
    rng = np.random.default_rng(cp)
    doc_lens = rng.integers(1, 15, size=5)
    check_plan(llama3_like_plan(doc_lens, cp), doc_lens)
    doc_lens = 2 * cp * rng.integers(1, 4, size=3)
    check_plan(perdoc_like_plan(doc_lens, cp), doc_lens, num_kv_heads=4)


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
