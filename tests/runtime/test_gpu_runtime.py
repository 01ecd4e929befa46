"""Does the runtime work on this device: auto's kernel choice, the ring and the LSE kernels of every backend, the
bf16 accuracy of every backend and comm mode, and the host syncs of a training step.

Each test runs three ways: on a CUDA device at full size (``gpu`` marker, skipped without CUDA; what
``scripts/gpu_check.sh`` runs first), on the CPU at toy size with the ``reference`` kernels, and on the CPU with
tests/fake_kernels.py's emulations of FA3, FA4, flash-attn 2.8 and torch's varlen kernels on a device that
says compute capability 9.0. Accuracy is judged as flash-attention's own tests do: the max error of out, dq, dk
and dv against float64 must be at most twice that of a plain-PyTorch bf16 dense implementation (+1e-5).
"""

import math
import warnings

import numpy as np
import pytest
import torch

from flashcp.runtime import kernels
from flashcp.runtime.kernels import GPU_BACKENDS, backend_available
from flashcp.runtime.meta import COMM_MODES
from tests import fake_kernels
from tests.emulate import emulate_cp_attention, random_plan
from tests.plans import random_rows

EMULATED = ("fa3", "fa4", "flash_attn-2.8", "torch_varlen")
BACKENDS = (*GPU_BACKENDS, "reference")


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("fakes", id="cpu-emulated-backends"),
                        pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")])
def device(request):
    """The device; with ``fakes`` the CPU with the emulated GPU libraries installed."""
    if request.param != "fakes":
        yield torch.device(request.param)
        return
    undo = fake_kernels.install(*EMULATED)
    try:
        yield torch.device("cpu")
    finally:
        undo()


def _small(device) -> bool:
    return device.type == "cpu"


def _probe(device, dtype=torch.bfloat16):
    return torch.zeros(2, 8, 128, device=device, dtype=dtype)


def _skip_unless_runs(backend, device, probe, blockwise=False):
    if backend == "reference" and device.type == "cuda":
        pytest.skip("on CUDA the GPU kernels are checked; the reference kernel is checked on the CPU")
    if not backend_available(backend, probe, blockwise=blockwise):
        why = kernels.unavailable_reason(backend, probe, blockwise=blockwise)
        pytest.skip(f"{backend} is not available here: {why}")


def dense_attention(q, k, v, doc_lens):
    """Plain PyTorch: dense scores over the whole sequence with a document-causal mask, in q's dtype."""
    context_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(doc_lens), device=q.device),
                                  torch.as_tensor(doc_lens, device=q.device))
    pos = torch.arange(context_len, device=q.device)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(group, 1)) / math.sqrt(head_dim)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v.repeat_interleave(group, 1))


def float64_reference(device, doc_lens, heads, kv_heads, head_dim, seed):
    """(q, k, v, [out, dq, dk, dv], grad) in float64: dense document-masked attention."""
    context_len = int(np.sum(doc_lens))
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v, grad = (torch.randn(context_len, h, head_dim, dtype=torch.float64, device=device, generator=gen)
                     for h in (heads, kv_heads, kv_heads, heads))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*leaves, doc_lens)
    ref.backward(grad)
    return q, k, v, [ref.detach()] + [t.grad for t in leaves], grad


def errors_against(fn, reference, dtype) -> list[float]:
    """Max |error| of (out, dq, dk, dv) of ``fn`` run in ``dtype`` against the float64 ``reference``."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in reference[:3]]
    out = fn(*inputs)
    out.backward(reference[4].to(dtype))
    got = [out] + [t.grad for t in inputs]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, reference[3])]


def _within_plain_bf16(fn, doc_lens, reference) -> None:
    plain = errors_against(lambda q, k, v: dense_attention(q, k, v, doc_lens), reference, torch.bfloat16)
    errs = errors_against(fn, reference, torch.bfloat16)
    assert all(e <= 2 * p + 1e-5 for e, p in zip(errs, plain)), \
        f"max |error| of out, dq, dk, dv {[f'{e:.2e}' for e in errs]} above 2x plain bf16 {plain}"


def _sequence(context_len: int, seed: int) -> np.ndarray:
    """One document over half the context (it spans several ranks), then a few shorter ones."""
    rng = np.random.default_rng(seed)
    return np.r_[context_len // 2, random_rows(rng, 1, context_len - context_len // 2, (3, 9))[0]]


def test_auto_picks_a_kernel_that_runs_bf16(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto may say why it passed a library over
        choice = (kernels.resolve_backend("auto", _probe(device)),
                  kernels.resolve_backend("auto", _probe(device), blockwise=True),
                  kernels.resolve_backend("auto", _probe(device, torch.float32)))
    if device.type == "cuda":
        assert choice[0] != "reference", f"no GPU kernel runs bf16 on this device: auto chose {choice}"
    elif backend_available("fa3", _probe(device)):  # the emulated libraries
        assert choice == ("fa3", "fa3", "reference")
    else:
        assert choice == ("reference", "reference", "reference")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_ring_forward_and_backward_match_float64(device, backend):
    _skip_unless_runs(backend, device, _probe(device), blockwise=True)
    context_len, cp, heads, kv_heads, head_dim = (96, 3, 4, 2, 16) if _small(device) else (1024, 4, 8, 2, 128)
    doc_lens = _sequence(context_len, seed=1)
    plan = random_plan(doc_lens, cp, np.random.default_rng(1), max_pieces=6, cut_prob=4.0 / context_len)
    reference = float64_reference(device, doc_lens, heads, kv_heads, head_dim, seed=2)
    _within_plain_bf16(lambda q, k, v: emulate_cp_attention(q, k, v, plan, doc_lens, "ring", backend), doc_lens,
                       reference)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_of_length_1_query_shards_under_gqa(device, backend, head_dim):
    _skip_unless_runs(backend, device, _probe(device), blockwise=True)
    heads, kv_heads, k_lens = 8, 2, [1, 3, 7, 2, 9, 5]
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(len(k_lens), heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(sum(k_lens), kv_heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
            for _ in range(2))
    cu_q = torch.arange(len(k_lens) + 1, dtype=torch.int32, device=device)
    cu_k = torch.tensor(np.r_[0, np.cumsum(k_lens)], dtype=torch.int32, device=device)
    out, lse = kernels.varlen_attention_forward(q, k, v, cu_q, cu_k, 1, max(k_lens), True, backend)
    assert lse.shape == (len(k_lens), heads) and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    want = []
    for i, n in enumerate(k_lens):
        keys = k[int(np.sum(k_lens[:i])):][:n].double().repeat_interleave(heads // kv_heads, 1)
        want.append(torch.logsumexp(torch.einsum("hd,khd->hk", q[i].double(), keys) / math.sqrt(head_dim), -1))
    err = (lse.double() - torch.stack(want)).abs().max().item()
    assert err < 1e-2, f"LSE max |error| {err:.2e}"
    grads = kernels.varlen_attention_backward(torch.ones_like(q), q, k, v, out, lse, cu_q, cu_k, 1, max(k_lens),
                                              True, backend)
    assert [tuple(g.shape) for g in grads] == [tuple(t.shape) for t in (q, k, v)]


@pytest.mark.parametrize("comm", COMM_MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_cp_attention_is_as_accurate_as_plain_pytorch(device, backend, comm):
    context_len, cp, heads, kv_heads, head_dim = (96, 4, 4, 2, 16) if _small(device) else (4096, 4, 8, 2, 128)
    reference = float64_reference(device, doc_lens := _sequence(context_len, seed=0), heads, kv_heads, head_dim,
                                  seed=0)
    _skip_unless_runs(backend, device, reference[0][:1].to(torch.bfloat16))
    plan = random_plan(doc_lens, cp, np.random.default_rng(0), max_pieces=6, cut_prob=2.0 / context_len)
    _within_plain_bf16(lambda q, k, v: emulate_cp_attention(q, k, v, plan, doc_lens, comm, backend), doc_lens,
                       reference)


def test_a_bf16_training_step_syncs_the_host_at_most_once(device):
    """Two bf16 training steps of a tiny model on one rank; CUDA counts the host syncs of the second (flashcp's
    step makes one, its read after the optimizer step)."""
    from flashcp.models.tiny import TinyConfig, TinyDecoder
    from flashcp.runtime.loader import Batch
    from flashcp.runtime.meta import CPAttnMeta, rank_token_positions
    from flashcp.train import train_step

    doc_lens = np.array([30, 1, 15, 6] if _small(device) else [300, 1, 150, 61])
    dim = 32 if _small(device) else 256
    plan = random_plan(doc_lens, 1, np.random.default_rng(4))
    _, doc_pos, doc = rank_token_positions(plan, doc_lens, 0)
    ids = torch.randint(0, 256, (int(doc_lens.sum()),))
    last = np.r_[doc[1:] != doc[:-1], True]
    labels = torch.where(torch.from_numpy(last), -100, torch.roll(ids, -1))
    batch = Batch(input_ids=ids, position_ids=torch.from_numpy(doc_pos), labels=labels,
                  attn=CPAttnMeta.from_plan(plan, doc_lens, 0), num_label_tokens=int((labels != -100).sum()),
                  file_index=0, row=0)
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=256, dim=dim, num_layers=2, num_heads=4, num_kv_heads=2,
                                   ffn_dim=2 * dim)).to(device, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [train_step(model, optimizer, batch.to(device, non_blocking=True, comm="auto")).loss]
    moved = batch.to(device, non_blocking=True, comm="auto")
    if device.type != "cuda":
        losses.append(train_step(model, optimizer, moved).loss)
        assert all(math.isfinite(loss) for loss in losses), losses
        return
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            losses.append(train_step(model, optimizer, moved).loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, f"losses {losses}; {len(syncs)} host syncs: {syncs}"
