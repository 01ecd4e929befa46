"""Every installed GPU kernel backend on a real CUDA device: cp_attention of every rank (emulated exchange,
one process) against float64 dense attention with a document mask, forward and backward. Skipped without
CUDA (``gpu`` marker, tests/conftest.py); the CPU emulations of the same APIs are tests/runtime/test_kernels.py."""

import numpy as np
import pytest
import torch

from flashcp.planner import plan_sequence
from flashcp.runtime.kernels import GPU_BACKENDS, backend_available
from tests.emulate import emulate_cp_attention
from tests.naive import naive_document_attention

pytestmark = pytest.mark.gpu

TOL = 3e-2  # bf16 inputs and outputs, float32 accumulation


@pytest.mark.parametrize("comm", ["allgather", "a2a", "ring"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backend_matches_the_float64_reference(backend, comm):
    rng = np.random.default_rng(0)
    doc_lens = rng.integers(1, 700, 12)
    cp, heads, kv_heads, dim = 4, 8, 2, 128
    plan = plan_sequence("flashcp", doc_lens, cp)
    context_len = int(doc_lens.sum())
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(context_len, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (heads, kv_heads, kv_heads))
    if not backend_available(backend, q, blockwise=comm == "ring"):
        pytest.skip(f"{backend} is not available here")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad = torch.randn(context_len, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = emulate_cp_attention(q, k, v, plan, doc_lens, comm=comm, backend=backend)
    got = torch.autograd.grad(out, (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    ref = naive_document_attention(q64, k64, v64, doc_lens)
    want = torch.autograd.grad(ref, (q64, k64, v64), grad.double().cpu())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *want)):
        err = (a.double().cpu() - b).abs().max().item()
        assert err < TOL * max(1.0, b.abs().max().item()), f"{backend}/{comm} {name}: max |err| {err}"
