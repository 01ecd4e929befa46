"""Every installed GPU kernel backend on a real CUDA device: cp_attention of every rank (emulated exchange,
one process) against float64 dense attention with a document mask, forward and backward, for full attention
and for the layer kinds (window, chunk, sinks, soft-cap) with their per-kind exchange. Skipped without
CUDA (``gpu`` marker, tests/conftest.py); the CPU emulations of the same APIs are tests/runtime/test_kernels.py."""

import numpy as np
import pytest
import torch

from flashcp.planner import plan_sequence
from flashcp.runtime.attention import attention_after_exchange
from flashcp.runtime.kernels import GPU_BACKENDS, backend_available
from flashcp.runtime.layer_kinds import LayerKind
from flashcp.runtime.meta import build_rank_metas, rank_token_positions
from tests.emulate import emulate_cp_attention, emulate_exchange
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


# the layer kinds today's open models use, at sizes that cut documents: Mistral/Gemma windows, Llama 4 chunks,
# gpt-oss window + sinks, Gemma 2 window + soft-cap
KINDS = ({"window": 128}, {"chunk": 256}, {"window": 64, "sinks": True}, {"window": 128, "softcap": 30.0})


@pytest.mark.parametrize("comm", ["allgather", "a2a"])
@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_layer_kinds_match_the_float64_reference(backend, kind, comm):
    """Each rank's per-kind exchange (``CPAttnMeta.for_kind``, emulated in one process) and the backend's
    kernel for the kind, bf16 on CUDA, against float64 dense attention with the document and the layer's mask."""
    layer = {name: value for name, value in kind.items() if name != "sinks"}
    rng = np.random.default_rng(1)
    doc_lens = rng.integers(1, 900, 10)
    cp, heads, kv_heads, dim = 4, 8, 2, 128
    plan = plan_sequence("flashcp", doc_lens, cp)
    context_len = int(doc_lens.sum())
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, grad = (torch.randn(context_len, h, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (heads, kv_heads, kv_heads, heads))
    if not backend_available(backend, q, **layer):
        pytest.skip(f"{backend} cannot run {layer} here")
    sinks = torch.randn(heads, device="cuda", dtype=torch.float32, generator=gen) if kind.get("sinks") else None
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if sinks is not None else [])
    positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, r)[0]).cuda() for r in range(cp)]
    metas = [m.for_kind(window=layer.get("window"), chunk=layer.get("chunk")) for m in build_rank_metas(plan, doc_lens)]
    ks, vs = [k[p] for p in positions], [v[p] for p in positions]
    recvs = emulate_exchange([m.to("cuda") for m in metas], ks, vs, comm)
    out = torch.zeros_like(q)
    for r, meta in enumerate(metas):
        out_r = attention_after_exchange(q[positions[r]], ks[r], vs[r], recvs[r], meta.to("cuda"), comm,
                                         backend=backend, kind=LayerKind(**layer), sinks=sinks)
        out = out.index_put((positions[r],), out_r)
    got = torch.autograd.grad(out, leaves, grad)
    ref_leaves = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref = naive_document_attention(*ref_leaves[:3], doc_lens, sinks=ref_leaves[3] if sinks is not None else None,
                                   **layer)
    want = torch.autograd.grad(ref, ref_leaves, grad.double().cpu())
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *got), (ref, *want)):
        err = (a.double().cpu() - b).abs().max().item()
        assert err < TOL * max(1.0, b.abs().max().item()), f"{backend}/{comm} {kind} {name}: max |err| {err}"
