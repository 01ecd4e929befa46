"""``softmax_scale``: the kernels and cp_attention honour a scale other than 1/sqrt(D) (float64, 1e-10)."""

import numpy as np
import pytest
import torch

from flashcp.runtime.kernels import varlen_attention
from flashcp.runtime.meta import COMM_MODES
from tests.emulate import emulate_cp_attention, random_plan
from tests.naive import naive_document_attention
from tests.runtime import max_errors, qkv

TOL = 1e-10


@pytest.mark.parametrize("scale", [None, 0.125, 1.7])
def test_reference_kernel_scale(scale):
    q, k, v = qkv(7, 4, 2)
    ref = naive_document_attention(q, k, v, [7], scale=scale)
    out = varlen_attention(q[2:], k, v, torch.tensor([0, 5], dtype=torch.int32),
                           torch.tensor([0, 7], dtype=torch.int32), 5, 7, "reference", softmax_scale=scale)
    assert (out - ref[2:]).abs().max().item() < TOL


def test_scale_changes_the_result():
    # guards against a scale that is accepted and then ignored
    q, k, v = qkv(6, 2, 2)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    default = varlen_attention(q, k, v, cu, cu, 6, 6, "reference")
    scaled = varlen_attention(q, k, v, cu, cu, 6, 6, "reference", softmax_scale=3.0)
    assert (default - scaled).abs().max().item() > 1e-3


@pytest.mark.parametrize("comm", COMM_MODES)
def test_cp_attention_scale_forward_and_backward(comm):
    rng = np.random.default_rng(3)
    doc_lens = np.array([9, 1, 14, 4])
    plan = random_plan(doc_lens, 3, rng, max_pieces=3, cut_prob=0.2)
    q, k, v = qkv(int(doc_lens.sum()), 4, 2, seed=1)
    ref = naive_document_attention(q, k, v, doc_lens, scale=0.21)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = emulate_cp_attention(q, k, v, plan, doc_lens, comm, "reference", softmax_scale=0.21)
    errors = max_errors(out, ref.detach(), (q, k, v), grad_out, ref_grads)
    assert max(errors) < TOL, f"{comm}: max |err| of out, dq, dk, dv = {errors}"
