"""Layer kinds (window, chunk, sinks, soft-cap) of cp_attention against a float64 single-process reference.

The reference (``tests/naive.py``) is dense attention over the whole packed sequence with the document mask
and the layer's own mask. On 2 and 4 gloo ranks every comm mode runs forward and backward (dq, dk, dv and the
sinks' gradient) for random plans, one document spread over every rank (shards of length 1), and documents
shorter and longer than the window and the chunk. The GPU backends run windows through their CPU fakes.
"""

import warnings

import numpy as np
import pytest
import torch

from flashcp.runtime import cp_attention
from flashcp.runtime.comm import CommStats
from flashcp.runtime.kernels import (
    BackendFallbackWarning,
    BackendUnavailableError,
    resolve_backend,
    varlen_attention_backward,
    varlen_attention_forward,
)
from flashcp.runtime.layer_kinds import LayerKind
from flashcp.runtime.meta import CPAttnMeta, rank_token_positions
from tests import fake_kernels
from tests.dist import spawn
from tests.emulate import random_plan
from tests.naive import naive_document_attention
from tests.runtime.attention_cases import build_cases, max_abs

TOL = 1e-10
COMMS = ("allgather", "a2a", "full")
KINDS = ({"window": 3}, {"chunk": 4}, {"softcap": 1.5}, {"sinks": True}, {"window": 1},
         {"window": 5, "sinks": True}, {"window": 5, "softcap": 2.0})
"""W = 3 and K = 4 against documents of 1 to 14 tokens: shorter and longer than both; W = 1: itself only;
window + sinks as gpt-oss combines them, window + soft-cap as Gemma 2 does."""


def _kind_case(name, plan, doc_lens, num_heads, num_kv_heads, kinds, rank, failures, scale=0.4):
    context_len = int(np.sum(doc_lens))
    gen = torch.Generator().manual_seed(7)
    q, k, v, grad_out = (torch.randn(context_len, h, 8, dtype=torch.float64, generator=gen)
                         for h in (num_heads, num_kv_heads, num_kv_heads, num_heads))
    sinks = torch.randn(num_heads, dtype=torch.float64, generator=gen)
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
    for kind in kinds:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        args = {**kind, "sinks": leaves[3] if kind.get("sinks") else None}
        ref = naive_document_attention(*leaves[:3], doc_lens, scale=scale, **args)
        used = leaves if kind.get("sinks") else leaves[:3]
        ref_grads = torch.autograd.grad(ref, used, grad_out)
        for comm in COMMS:
            local = [t.detach()[pos].requires_grad_() for t in (q, k, v)]
            local_sinks = sinks.clone().requires_grad_()
            args = {**kind, "sinks": local_sinks if kind.get("sinks") else None}
            out = cp_attention(*local, meta, comm=comm, softmax_scale=scale, **args)
            out.backward(grad_out[pos])
            errors = [max_abs(out, ref[pos])] + [max_abs(t.grad, g[pos]) for t, g in zip(local, ref_grads)]
            if kind.get("sinks"):  # each rank holds the gradient of its own queries: sum over ranks
                dsinks = local_sinks.grad.clone()
                torch.distributed.all_reduce(dsinks)
                errors.append(max_abs(dsinks, ref_grads[3]))
            if max(errors) >= TOL:
                failures.append(f"{name} H={num_heads} K={num_kv_heads} {kind} comm={comm}: max |err| of out, dq, "
                                f"dk, dv(, dsinks) = {errors}")


def _kind_volumes(plan, doc_lens, rank):
    """The collectives of a window layer move what its meta says, and less than full attention's in all."""
    failures = []
    meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
    x = torch.zeros(meta.num_tokens, 2, 8, dtype=torch.float64, requires_grad=True)
    moved = []
    for kind in ({}, {"window": 3}):
        stats = CommStats()
        cp_attention(x, x, x, meta, comm="a2a", stats=stats, **kind).sum().backward()
        got = (stats.total("sent_tokens", "forward"), stats.total("recv_tokens", "forward"))
        if got != meta.for_kind(**kind).wire_tokens("a2a"):
            failures.append(f"rank {rank} {kind}: the a2a moved {got}, its meta says "
                            f"{meta.for_kind(**kind).wire_tokens('a2a')}")
        moved.append(torch.tensor(float(got[1])))
        torch.distributed.all_reduce(moved[-1])
    if not moved[1] < moved[0]:
        failures.append(f"a window of 3 received {moved[1].item()} tokens in all, full attention {moved[0].item()}")
    return failures


def _worker(rank, world_size):
    failures = []
    keep = ("random0", "random1", "random2", "one-doc", "strategy-flashcp+", "empty-ranks")  # GQA, MHA, MQA
    cases = [case for case in build_cases(world_size) if case[0] in keep]
    rng = np.random.default_rng(500 + world_size)
    doc_lens = np.array([1, 2, 3, 4, 5, 9, 14])  # shorter, equal to and longer than W = 3 and K = 4
    cases.append(("short-long", random_plan(doc_lens, world_size, rng, max_pieces=1000, cut_prob=0.5),
                  doc_lens, 4, 2))
    for name, plan, doc_lens, num_heads, num_kv_heads in cases:
        _kind_case(name, plan, doc_lens, num_heads, num_kv_heads, KINDS, rank, failures)
    failures += _kind_volumes(*cases[-1][1:3], rank)
    # the ring computes plain causal attention and says so
    name, plan, doc_lens, *_ = cases[0]
    meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
    x = torch.zeros(meta.num_tokens, 2, 8, dtype=torch.float64)
    try:
        cp_attention(x, x, x, meta, comm="ring", window=4)
        failures.append("the ring accepted a window")
    except ValueError as e:
        if "comm='ring' computes plain causal attention only, got window=4" not in str(e):
            failures.append(f"unexpected ring refusal: {e}")
    return failures


@pytest.mark.parametrize("world_size", [2, 4])
def test_layer_kinds_match_dense_reference_on_gloo(world_size):
    spawn(_worker, world_size)


@pytest.mark.parametrize("kind, message", [
    ({"window": 0}, "window must be a positive number of tokens"),
    ({"chunk": 2.5}, "chunk must be a positive number of tokens"),
    ({"softcap": -1.0}, "softcap must be a positive number"),
])
def test_layer_kind_refuses_nonsense(kind, message):
    with pytest.raises(ValueError, match=message):
        LayerKind(**kind)


def test_sinks_must_be_one_logit_per_head():
    doc_lens = np.array([4])
    meta = CPAttnMeta.from_plan(random_plan(doc_lens, 1, np.random.default_rng(0)), doc_lens, 0)
    x = torch.zeros(4, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sinks must be a floating \(H,\) = \(4,\) tensor"):
        cp_attention(x, x, x, meta, sinks=torch.zeros(2, dtype=torch.float64))


# ---------------------------------------------------------------- the GPU backends, through their fakes

@pytest.fixture
def installed():
    undo = []
    yield lambda *names, capability=(9, 0): undo.append(fake_kernels.install(*names, capability=capability))
    for fn in reversed(undo):
        fn()


WINDOW_FAKES = ("flash_attn-2.6", "flash_attn-2.8", "fa3", "fa3-2025-04", "fa4", "torch_varlen")
SOFTCAP_BACKENDS = ("flash_attn", "fa3")
"""Whose forward and backward both take a soft-cap (FA2 2.6+, FA3); FA4's backward ignores it."""


@pytest.mark.parametrize("layer", ["window", "chunk"])
@pytest.mark.parametrize("fake", WINDOW_FAKES)
def test_layer_kinds_with_sinks_through_each_fake(fake, layer, installed):
    installed(fake)
    backend = fake_kernels.BACKEND_OF[fake]
    if layer == "chunk":  # split into plain causal sequences: every backend runs it
        kind = {"chunk": 4}
    else:
        kind = {"window": 5, "softcap": 1.5} if backend in SOFTCAP_BACKENDS else {"window": 5}
    doc_lens = np.array([9, 1, 14, 4])
    plan = random_plan(doc_lens, 1, np.random.default_rng(3))
    meta = CPAttnMeta.from_plan(plan, doc_lens, 0)
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, 0)[0])
    gen = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(28, h, 16, generator=gen).bfloat16() for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=gen)
    assert resolve_backend("auto", q, blockwise=True, **kind) == backend
    results = []
    for dtype in (torch.float64, torch.bfloat16):  # the float64 truth and a plain bf16 implementation's error
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        out = naive_document_attention(*leaves[:3], doc_lens, sinks=leaves[3], **kind)
        results.append((out[pos], *(g[pos] if g.dim() == 3 else g
                                    for g in torch.autograd.grad(out, leaves, grad.to(dtype)))))
    leaves = [t[pos].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out = cp_attention(*leaves[:3], meta, backend=backend, sinks=leaves[3], **kind)
    got = (out, *torch.autograd.grad(out, leaves, grad[pos]))
    errors = [(a.double() - b.double()).abs().max().item() for a, b in zip(got, results[0])]
    bound = [2 * (p.double() - b.double()).abs().max().item() + 1e-5 for p, b in zip(results[1], results[0])]
    assert all(e <= b for e, b in zip(errors, bound)), f"{fake}: max |err| {errors} above 2x plain bf16 {bound}"
    ref64 = naive_document_attention(q.double(), k.double(), v.double(), doc_lens)[pos]
    assert (out.double() - ref64).abs().max() > 1e-2  # the kind changed the result: it was not dropped


@pytest.mark.parametrize("fake", ["flash_attn-2.8", "fa3", "fa4", "torch_varlen"])
def test_chunks_run_as_plain_causal_sequences_on_backends_without_them(fake, installed):
    """The kernels' own entry points with a chunk: key sequences from the document's start, queries late."""
    installed(fake)
    backend = fake_kernels.BACKEND_OF[fake]
    gen = torch.Generator().manual_seed(5)
    num_q, num_k = [3, 9, 1, 4], [11, 9, 6, 4]  # the first and third skip whole chunks of K = 4 before their queries
    cu_q, cu_k = (torch.tensor(np.r_[0, np.cumsum(n)], dtype=torch.int32) for n in (num_q, num_k))
    q, dout = (torch.randn(sum(num_q), 4, 16, generator=gen).bfloat16() for _ in range(2))
    k, v = (torch.randn(sum(num_k), 2, 16, generator=gen).bfloat16() for _ in range(2))
    lengths = (cu_q, cu_k, max(num_q), max(num_k))
    out, lse = varlen_attention_forward(q, k, v, *lengths, causal=True, backend=backend, chunk=4, window=3)
    grads = varlen_attention_backward(dout, q, k, v, out, lse, *lengths, causal=True, backend=backend, chunk=4,
                                      window=3)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    out64, lse64 = varlen_attention_forward(q64, k64, v64, *lengths, causal=True, backend="reference", chunk=4,
                                            window=3)
    grads64 = varlen_attention_backward(dout.double(), q64, k64, v64, out64, lse64, *lengths, causal=True,
                                        backend="reference", chunk=4, window=3)
    errors = [(a.double() - b).abs().max().item() for a, b in zip((out, lse, *grads), (out64, lse64, *grads64))]
    assert max(errors) < 3e-2, f"{fake}: max |err| of out, lse, dq, dk, dv vs float64 reference: {errors}"
    plain, _ = varlen_attention_forward(q64, k64, v64, *lengths, causal=True, backend="reference", window=3)
    assert (plain - out64).abs().max() > 0.1  # the chunk mattered
    skipped = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 23])  # keys of chunks before any query
    assert grads[1][skipped].abs().max() == 0 and grads[2][skipped].abs().max() == 0


def test_kinds_a_backend_cannot_run_are_refused_and_auto_falls_back(installed):
    installed("fa3", "fa4", "flash_attn-2.8", "torch_varlen")
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    for backend in ("fa3", "fa4", "flash_attn", "torch_varlen"):  # chunks: split into plain causal sequences
        assert resolve_backend(backend, q, chunk=8) == backend
    assert resolve_backend("fa3", q, softcap=30.0, window=8) == "fa3"
    with pytest.raises(BackendUnavailableError, match=r"torch_varlen takes no logit soft-capping \(softcap=30.0\)"):
        resolve_backend("torch_varlen", q, softcap=30.0)
    with pytest.raises(BackendUnavailableError, match="does not pass logit soft-capping .softcap=30.0. to fa4: its "
                                                      "_flash_attn_bwd ignores softcap"):
        resolve_backend("fa4", q, softcap=30.0)
    assert resolve_backend("auto", q, softcap=30.0, window=8) == "fa3"
    assert resolve_backend("auto", q, chunk=8) == "fa3"


def test_auto_passes_over_a_backend_that_cannot_soft_cap(installed):
    installed("fa4", "flash_attn-2.8", "torch_varlen")
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_backend("auto", q, softcap=30.0, window=8) == "flash_attn"  # FA2 takes the soft-cap
    said = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert len(said) == 1 and "skipped fa4 (flashcp does not pass logit soft-capping" in said[0], said
    installed("torch_varlen")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_backend("auto", q, softcap=30.0) == "reference"
    said = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert len(said) == 1 and "torch_varlen takes no logit soft-capping" in said[0], said
    assert "head dim 64 and softcap=30.0" in said[0] and "FA2 and FA3 soft-caps" in said[0]
