"""Helpers of the runtime tests: random inputs, float64 reference checks of emulated plans."""

import math

import numpy as np
import torch
from hypothesis import strategies as st

from flashcp.runtime.meta import COMM_MODES
from tests.emulate import emulate_cp_attention, random_plan
from tests.naive import naive_document_attention

TOL = 1e-10


def qkv(context_len, num_heads, num_kv_heads, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        return torch.randn(context_len, h, head_dim, dtype=torch.float64, generator=gen, requires_grad=True)

    return rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)


def dense(q, k, v, causal):
    """Plain attention of one sequence in q's dtype (bottom-right causal or none): (out (n, H, D), lse (n, H))."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kf) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.arange(k.shape[0])[None] <= torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0]
        scores = scores.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf), torch.logsumexp(scores, -1).T


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
