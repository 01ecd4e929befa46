"""The Ring-Attn baselines without a process group: layout, cost model, schedule, kernels, merge, emulation.

The gloo runs of ``comm="ring"`` (2-4 ranks, bytes moved per step) are in test_runtime_dist.py.
"""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashcp.costmodel.comm import ring_comm_tokens, ring_step_work
from flashcp.costmodel.workload import rank_workloads, token_quotas
from flashcp.planner.strategies.baselines import ring_plan
from flashcp.runtime import CPAttnMeta, cp_attention
from flashcp.runtime.kernels import (
    BackendUnavailableError,
    reference,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from flashcp.runtime.meta import build_rank_metas, rank_token_positions
from flashcp.runtime.ring import merge_partial
from tests.emulate import emulate_cp_attention, random_plan
from tests.naive import naive_document_attention, naive_ring_comm, naive_ring_plan, naive_ring_step_work
from tests.plans import llama3_like_plan, perdoc_like_plan
from tests.runtime import dense

TOL = 1e-10


def shard_rows(plan):
    arrays = (plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank)
    return list(zip(*(a.tolist() for a in arrays)))


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def cu(lengths):
    return torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)


# ---------------------------------------------------------------- layout and cost model

@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(1, 6))
def test_ring_plan_matches_naive_layout(doc_lens, cp):
    plan = ring_plan(doc_lens, cp)
    plan.validate(doc_lens)
    assert shard_rows(plan) == naive_ring_plan(doc_lens, cp)
    canonical = plan.sorted()
    assert (canonical.shard_rank == plan.shard_rank).all() and (canonical.shard_doc == plan.shard_doc).all()
    for rank in range(cp):  # contiguous: rank r holds [sum(quotas[:r]), sum(quotas[:r+1]))
        global_pos = rank_token_positions(plan, doc_lens, rank)[0]
        first = int(token_quotas(sum(doc_lens), cp)[:rank].sum())
        assert global_pos.tolist() == list(range(first, first + global_pos.size))


def test_ring_plan_refuses_bad_input():
    with pytest.raises(ValueError, match="positive lengths"):
        ring_plan([3, 0], 2)
    with pytest.raises(ValueError, match="positive lengths"):
        ring_plan([], 2)
    with pytest.raises(ValueError, match="cp must be at least 1"):
        ring_plan([3], 0)


def some_plans(rng, trials=25):
    """(plan, doc_lens) of random, ring, llama3-like and per-doc-like layouts."""
    for _ in range(trials):
        cp = int(rng.integers(1, 6))
        doc_lens = rng.integers(1, 14, size=int(rng.integers(1, 7)))
        if doc_lens.sum() < cp:
            doc_lens = np.r_[doc_lens, cp]
        yield random_plan(doc_lens, cp, rng, max_pieces=int(rng.integers(1, 6)), cut_prob=0.2), doc_lens
        yield ring_plan(doc_lens, cp), doc_lens
        yield llama3_like_plan(doc_lens, cp), doc_lens
        doc_lens = 2 * cp * rng.integers(1, 3, size=3)
        yield perdoc_like_plan(doc_lens, cp), doc_lens


def test_ring_step_work_and_comm_match_naive():
    for plan, doc_lens in some_plans(np.random.default_rng(5)):
        cp = plan.cp
        shards = shard_rows(plan)
        work = ring_step_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        naive = naive_ring_step_work(shards, cp)
        for name, expected in naive.items():
            assert getattr(work, name).tolist() == expected, name
        # the ring splits each rank's causal work over its steps without adding or losing a pair
        assert (work.pairs.sum(axis=1) == rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank,
                                                          cp)).all()
        assert (work.kernel_calls == (np.array(naive["sequences"]) > 0).sum(axis=1)).all()
        assert (work.query_tokens[:, 0] == token_quotas(int(np.sum(doc_lens)), cp)).all(), "step 0: all"
        sent, received = ring_comm_tokens(plan.shard_len, plan.shard_rank, cp)
        assert (sent.tolist(), received.tolist()) == naive_ring_comm(token_quotas(int(np.sum(doc_lens)),
                                                                                  cp).tolist())


def test_ring_comm_is_all_but_one_block():
    plan = ring_plan([40, 24], 4)  # C = 64 = 4 * 16
    sent, received = ring_comm_tokens(plan.shard_len, plan.shard_rank, 4)
    assert sent.tolist() == received.tolist() == [48] * 4  # (N-1)/N of the sequence


# ---------------------------------------------------------------- schedule

def test_ring_schedule_matches_the_cost_model():
    for plan, doc_lens in some_plans(np.random.default_rng(11), trials=15):
        cp = plan.cp
        work = ring_step_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
        sent, received = ring_comm_tokens(plan.shard_len, plan.shard_rank, cp)
        metas = build_rank_metas(plan, doc_lens)
        for rank, meta in enumerate(metas):
            ring = meta.ring
            assert ring.rank == rank and len(ring.steps) == cp and ring.active == (cp > 1)
            assert (ring.wire_send_tokens, ring.wire_recv_tokens) == (sent[rank], received[rank])
            assert meta.wire_tokens("ring") == (sent[rank], received[rank])
            assert ring.block_rows == tuple(m.num_tokens for m in metas)
            assert ring.steps[0].part.q_index.tolist() == list(range(meta.num_tokens))
            for step, s in enumerate(ring.steps):
                part = s.part
                assert s.source == (rank - step) % cp and s.causal == (step == 0)
                n = np.diff(part.cu_seqlens_q.numpy()).astype(np.int64)
                k = np.diff(part.cu_seqlens_k.numpy()).astype(np.int64)
                pairs = (n * (k - n) + n * (n + 1) // 2) if step == 0 else n * k
                assert pairs.sum() == work.pairs[rank, step]
                assert (part.num_tokens, k.sum(), n.size) == (work.query_tokens[rank, step],
                                                             work.key_tokens[rank, step],
                                                             work.sequences[rank, step])
                assert s.kv_index.numel() == k.sum()
                assert s.kv_index.numel() == 0 or int(s.kv_index.max()) < ring.block_rows[s.source]
                for rows, index in ((s.q_range, part.q_index), (s.kv_range, s.kv_index)):
                    n = index.numel()
                    contiguous = n > 0 and (index - index[0]).tolist() == list(range(n))
                    assert (rows is not None) == contiguous
                    assert rows is None or index.tolist() == list(range(*rows))


def test_ring_layout_steps_read_slices_not_copies():
    rng = np.random.default_rng(3)
    for cp in (2, 3, 4, 8):
        doc_lens = rng.integers(1, 40, size=8)
        for meta in build_rank_metas(ring_plan(doc_lens, cp), doc_lens):
            for step in meta.ring.steps:
                if step.part.num_tokens:
                    assert step.q_range is not None and step.kv_range is not None


# ---------------------------------------------------------------- kernels and merge

@pytest.mark.parametrize("formulas", [False, True], ids=["cpu-flash-ops", "written-out"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_reference_lse_kernels_equal_autograd(causal, heads, formulas, monkeypatch):
    if formulas:  # the path the reference backend takes off CPU
        monkeypatch.setattr(reference, "_use_cpu_flash", lambda q: False)
    q_lens, k_lens = [1, 3, 5, 1], [1, 7, 5, 4]  # length-1 sequences, exact squares, longer prefixes
    q = rand(sum(q_lens), heads[0], 8, seed=1).requires_grad_()
    k = rand(sum(k_lens), heads[1], 8, seed=2).requires_grad_()
    v = rand(sum(k_lens), heads[1], 8, seed=3).requires_grad_()
    cq, ck = cu(q_lens), cu(k_lens)
    pieces = [dense(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], causal) for i in range(4)]
    ref_out, ref_lse = (torch.cat(x) for x in zip(*pieces))
    grad = rand(*ref_out.shape, seed=4)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad)
    out, lse = varlen_attention_forward(q.detach(), k.detach(), v.detach(), cq, ck, 5, 7, causal, "reference")
    assert (out - ref_out).abs().max().item() < TOL and (lse - ref_lse).abs().max().item() < TOL
    if causal:
        assert (out - varlen_attention(q, k, v, cq, ck, 5, 7, "reference")).abs().max().item() < TOL
    got = varlen_attention_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, cq, ck, 5, 7, causal,
                                    "reference")
    errors = [(a - b).abs().max().item() for a, b in zip(got, ref_grads)]
    assert max(errors) < TOL, f"dq, dk, dv errors {errors}"


def test_blocks_merged_by_lse_equal_one_attention():
    # one query shard [6, 10) of a document; keys [0, 6) arrive in two blocks, its own keys are causal
    q = rand(4, 4, 8, seed=5).requires_grad_()
    k = rand(10, 2, 8, seed=6).requires_grad_()
    v = rand(10, 2, 8, seed=7).requires_grad_()
    ref, _ = dense(q, k, v, causal=True)
    grad = rand(*ref.shape, seed=8)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    blocks = [(slice(6, 10), True), (slice(0, 2), False), (slice(2, 6), False)]
    out = torch.zeros(4, 4, 8, dtype=torch.float64)
    lse = torch.full((4, 4), float("-inf"), dtype=torch.float64)
    index = torch.arange(4)
    calls = []
    for keys, causal in blocks:
        n = keys.stop - keys.start
        args = (k.detach()[keys], v.detach()[keys], cu([4]), cu([n]), 4, n, causal, "reference")
        block_out, block_lse = varlen_attention_forward(q.detach(), *args)
        merge_partial(out, lse, index, block_out, block_lse)
        calls.append(args)
    assert (out - ref).abs().max().item() < TOL
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (keys, _), args in zip(blocks, calls):
        bq, bk, bv = varlen_attention_backward(grad, q.detach(), args[0], args[1], out, lse, *args[2:])
        dq += bq
        dk[keys] += bk
        dv[keys] += bv
    errors = [(a - b).abs().max().item() for a, b in zip((dq, dk, dv), ref_grads)]
    assert max(errors) < TOL, f"dq, dk, dv errors {errors}"


def test_merge_is_stable_with_huge_scores():
    # scores of order 1e4 overflow exp() in float32 unless the merge works with differences of lse
    q = rand(3, 2, 8, seed=9, dtype=torch.float32) * 300
    k = rand(8, 2, 8, seed=10, dtype=torch.float32) * 300
    v = rand(8, 2, 8, seed=11, dtype=torch.float32)
    out = torch.zeros(3, 2, 8)
    lse = torch.full((3, 2), float("-inf"))
    for keys in (slice(0, 3), slice(3, 8)):
        n = keys.stop - keys.start
        block_out, block_lse = varlen_attention_forward(q, k[keys], v[keys], cu([3]), cu([n]), 3, n, False,
                                                        "reference")
        assert block_lse.dtype == torch.float32 and block_lse.abs().max() > 1e3
        merge_partial(out, lse, torch.arange(3), block_out, block_lse)
    ref, ref_lse = dense(q.double(), k.double(), v.double(), causal=False)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max().item() < 1e-3
    assert ((lse.double() - ref_lse).abs() / ref_lse.abs()).max().item() < 1e-6


def test_gpu_backends_are_refused_on_cpu():
    q = torch.zeros(2, 2, 4)
    with pytest.raises(BackendUnavailableError, match="'flash_attn' cannot run here: .*CUDA"):
        varlen_attention_forward(q, q, q, cu([2]), cu([2]), 2, 2, True, "flash_attn")


# ---------------------------------------------------------------- emulated baselines

@pytest.mark.parametrize("cp", [2, 3, 4])
def test_emulated_ring_baselines_match_dense_reference(cp):
    rng = np.random.default_rng(20 + cp)
    doc_lens = rng.integers(1, 20, size=6)
    cases = [("Ring-Attn", ring_plan(doc_lens, cp), doc_lens)]
    zigzag_lens = 2 * cp * rng.integers(1, 4, size=4)
    cases.append(("Ring-Attn (zigzag)", perdoc_like_plan(zigzag_lens, cp), zigzag_lens))
    for name, plan, lens in cases:
        context_len = int(np.sum(lens))
        q, k, v = (rand(context_len, h, 8, seed=s).requires_grad_() for s, h in enumerate((4, 2, 2)))
        ref = naive_document_attention(q, k, v, lens)
        grad = rand(*ref.shape, seed=9)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        out = emulate_cp_attention(q, k, v, plan, lens, "ring", "reference")
        got = torch.autograd.grad(out, (q, k, v), grad)
        errors = [(a - b).abs().max().item() for a, b in zip((out, *got), (ref, *ref_grads))]
        assert max(errors) < TOL, f"{name} cp={cp}: max |err| of out, dq, dk, dv = {errors}"


def test_ring_with_one_rank_needs_no_process_group():
    doc_lens = [4, 1, 6]
    meta = CPAttnMeta.from_plan(ring_plan(doc_lens, 1), doc_lens, 0)
    q, k, v = (rand(11, h, 8, seed=s).requires_grad_() for s, h in enumerate((4, 2, 2)))
    out = cp_attention(q, k, v, meta, comm="ring")
    ref = naive_document_attention(q, k, v, doc_lens)
    assert (out - ref).abs().max().item() < TOL
    grad = rand(*ref.shape, seed=5)
    got, want = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
    assert max((a - b).abs().max().item() for a, b in zip(got, want)) < TOL
