"""cp_attention on 3 gloo ranks through each emulated GPU backend (tests/fake_kernels.py), forward and backward.

Every rank installs the fake in its own process, runs the allgather, a2a and ring comm modes over bf16 inputs
(GQA, length-1 shards, a rank holding no tokens) and compares its slice of out / dq / dk / dv with a float64
dense document-masked reference on the same inputs, the error bounded by twice that of a plain bf16 dense
implementation. flash-attn 2.5 is installed beside torch_varlen: its padded LSE leaves the ring to
torch_varlen (auto), the collectives use it.
"""

import warnings

import numpy as np
import pytest
import torch

from flashcp.planner.strategies.baselines import ring_plan
from flashcp.runtime import CPAttnMeta, cp_attention
from flashcp.runtime.kernels import BackendFallbackWarning
from flashcp.runtime.meta import rank_token_positions
from tests import fake_kernels
from tests.dist import spawn
from tests.emulate import random_plan
from tests.fake_kernels import BACKEND_OF, FAKES
from tests.naive import naive_document_attention

COMMS = ("allgather", "a2a", "ring")


def cases(world_size):
    rng = np.random.default_rng(77)
    doc_lens = np.array([6, 1, 11, 3, 9])
    yield "random", random_plan(doc_lens, world_size, rng, max_pieces=5, cut_prob=0.3), doc_lens, 4, 2
    doc_lens = np.array([1, world_size - 2])  # fewer tokens than ranks: the last rank holds nothing
    yield "empty-rank", ring_plan(doc_lens, world_size), doc_lens, 4, 1


def reference(doc_lens, num_heads, num_kv_heads, seed):
    """bf16 inputs, and (out, dq, dk, dv) in float64 and in plain bf16 over the whole sequence."""
    context_len = int(np.sum(doc_lens))
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(context_len, h, 16, generator=gen).to(torch.bfloat16)
                     for h in (num_heads, num_kv_heads, num_kv_heads, num_heads))
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = naive_document_attention(*leaves, doc_lens)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, grad.to(dtype))])
    return (q, k, v, grad), results


def run_rank(rank, world_size):
    failures = []
    for fake in FAKES:
        names = (fake, "torch_varlen") if fake == "flash_attn-2.5" else (fake,)
        undo = fake_kernels.install(*names)
        try:
            for name, plan, doc_lens, num_heads, num_kv_heads in cases(world_size):
                (q, k, v, grad), (ref, plain) = reference(doc_lens, num_heads, num_kv_heads, seed=len(name))
                pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
                meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
                for comm in COMMS:
                    backend = "auto" if fake == "flash_attn-2.5" and comm == "ring" else BACKEND_OF[fake]
                    leaves = [t[pos].clone().requires_grad_() for t in (q, k, v)]
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", BackendFallbackWarning)
                        out = cp_attention(*leaves, meta, comm=comm, backend=backend)
                    out.backward(grad[pos])
                    got = [out.detach()] + [t.grad for t in leaves]
                    if pos.numel() == 0:  # it took part in every collective; nothing to compare
                        if any(g is not None and g.numel() for g in got):
                            failures.append(f"{fake} {name} {comm}: an empty rank got {got}")
                        continue
                    errs = [(g.double() - r[pos]).abs().max().item() for g, r in zip(got, ref)]
                    bound = [2 * (p[pos].double() - r[pos]).abs().max().item() + 1e-5 for p, r in zip(plain, ref)]
                    if any(e > b for e, b in zip(errs, bound)) or out.dtype != torch.bfloat16:
                        failures.append(f"{fake} {name} {comm} ({backend}): max |err| of out, dq, dk, dv {errs} "
                                        f"above 2x plain bf16 {bound}")
        finally:
            undo()
    return failures


@pytest.mark.slow
def test_cp_attention_through_each_fake_on_three_gloo_ranks():
    spawn(run_rank, 3)
