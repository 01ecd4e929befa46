"""CPU emulations of the GPU attention libraries flashcp calls, for CI without a GPU.

Each fake is written from the library's own source and mimics its Python API (names, parameters, defaults,
return values, ``torch.library.custom_op`` wrapping) and the checks its kernel makes (dtype, last-dim
contiguity, int32 cu_seqlens, head dim, one device for every tensor, LSE layout):

- ``flash_attn-2.5`` / ``-2.6`` / ``-2.8``: flash-attn's ``flash_attn_interface.py`` and
  ``csrc/flash_attn/flash_api.cpp`` at v2.5.9.post1 (padded ``(B, H, max_seqlen)`` varlen LSE, window_size
  tuple, no softcap), v2.6.3 (packed ``(H, T)`` LSE, plain functions, softcap forward and backward: scores
  ``softcap * tanh(scale * q.k / softcap)``, the C++ forward pads the head dim) and
  v2.8.3 (``torch.library.custom_op`` ops with window_size_left/right and zero_tensors; the Python wrapper
  pads the head dim, the C++ requires a multiple of 8);
- ``fa3``: ``hopper/flash_attn_interface.py`` at HEAD (the ``flash_attn_3::_flash_attn_backward`` custom op,
  ``flash_attn_varlen_func(..., return_attn_probs=True) -> (out, lse)``); ``fa3-2025-04``: the plain
  ``_flash_attn_backward(..., causal, window_size=(-1, -1), ...)`` of April 2025;
- ``fa4``: ``flash_attn/cute/interface.py`` (flash-attn-4 4.0.0b*: ``flash_attn_varlen_func`` with ``qv`` as
  its fourth positional parameter, always returning ``(out, lse)``; ``_flash_attn_bwd`` returning
  ``(dq, dk, dv)``; asserts; compute capability 9.x-12.x for the backward), installed as ``flash_attn.cute``
  inside a namespace package ``flash_attn``;
- ``torch_varlen``: CPU kernels for ``aten::_flash_attention_forward`` / ``_flash_attention_backward``, the
  ops torch 2.13's ``torch/nn/attention/varlen.py`` custom ops call, so the real ``varlen_attn`` and
  ``torch_attn::_varlen_attn(_backward)`` run unchanged.

Every kernel computes in float64 (per sequence, bottom-right aligned windows, +inf LSE for rows without
keys as flash-attn does) and rounds to the input dtype; backwards use the out and LSE they are given.
``install(name, capability)`` puts one fake in ``sys.modules`` (the other libraries read as not installed)
and makes ``flashcp.runtime.kernels._device_capability`` report ``capability`` for every device: the one
place flashcp looks at the device. The returned function undoes it.

A new library in ``flashcp.runtime.kernels`` (one ``Library`` record) comes with its fake here: a ``_make_*``
written from its source, its name in ``FAKES`` and ``BACKEND_OF``, its modules in ``LIBRARY_MODULES``.
"""

import importlib.abc
import importlib.machinery
import math
import sys
import types

import torch

from flashcp.runtime import kernels
from flashcp.runtime.kernels.library import parameters

FAKES = ("flash_attn-2.5", "flash_attn-2.6", "flash_attn-2.8", "fa3", "fa3-2025-04", "fa4", "torch_varlen")
"""Every emulated library."""
BACKEND_OF = {"flash_attn-2.5": "flash_attn", "flash_attn-2.6": "flash_attn", "flash_attn-2.8": "flash_attn",
              "fa3": "fa3", "fa3-2025-04": "fa3", "fa4": "fa4", "torch_varlen": "torch_varlen"}
"""The flashcp backend each fake stands for."""
LIBRARY_MODULES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.cute", "flash_attn.cute.interface",
                   "flash_attn_interface")

_state = {"capability": (9, 0)}


def check(condition: bool, message: str) -> None:
    """TORCH_CHECK: the kernels raise RuntimeError with their message."""
    if not condition:
        raise RuntimeError(message)


def _lengths(cu: torch.Tensor) -> list[int]:
    bounds = cu.tolist()
    return [b - a for a, b in zip(bounds, bounds[1:])]


def check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, half_only=True):
    """What flash-attn's varlen kernels check (and what they silently assume, which would corrupt memory)."""
    if half_only:
        check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check(t.device == q.device, f"{name} must be on CUDA (the device of q)")
    check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    check(cu_q.is_contiguous() and cu_k.is_contiguous(), "cu_seqlens_q must be contiguous")
    for t in (q, k, v):
        check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    check(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, "q must be (total_q, H, D), k and v (total_k, K, D)")
    check(q.shape[-1] == k.shape[-1], "query and key must have the same head dim")
    check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    check(cu_q.numel() == cu_k.numel() and cu_q.numel() >= 2, "cu_seqlens_q and cu_seqlens_k must be (B + 1,)")
    len_q, len_k = _lengths(cu_q), _lengths(cu_k)
    check(min(len_q) >= 0 and min(len_k) >= 0, "cu_seqlens must be non-decreasing")
    check(cu_q[-1].item() <= q.shape[0] and cu_k[-1].item() <= k.shape[0], "cu_seqlens beyond the tensors")
    # the grid is sized from max_seqlen: rows past it are never computed
    check(max(len_q) <= max_q and max(len_k) <= max_k, "a sequence is longer than max_seqlen")


def attend64(q, k, v, cu_q, cu_k, scale, causal, window=(-1, -1), softcap=0.0):
    """``(out (T, H, D) float64, lse (H, T) float64)``; bottom-right aligned causal mask and window.

    ``softcap`` > 0: scores ``softcap * tanh(scale * q.k / softcap)`` (flash-attn 2.6+'s ``params.softcap``).
    """
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float64)
    left, right = window[0], 0 if causal else window[1]
    for (qa, qb), (ka, kb) in zip(_pairs(cu_q), _pairs(cu_k)):
        nq, nk = qb - qa, kb - ka
        if nq == 0:
            continue
        qs = q[qa:qb].double()
        ks, vs = (t[ka:kb].double().repeat_interleave(group, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        keep = _window_keep(nq, nk, left, right)
        scores = scores.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(scores, -1)  # -inf for a row without keys
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", probs, vs)
        lse[:, qa:qb] = torch.where(torch.isinf(row_lse), math.inf, row_lse)
    return out, lse


def attend_backward64(dout, q, k, v, out, lse_HT, cu_q, cu_k, scale, causal, window=(-1, -1), softcap=0.0):
    """``(dq, dk, dv)`` in float64 from the given out and LSE (as the kernels do); dk, dv summed per KV head."""
    num_kv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk, dv = (torch.zeros(k.shape, dtype=torch.float64) for _ in range(2))
    left, right = window[0], 0 if causal else window[1]
    for (qa, qb), (ka, kb) in zip(_pairs(cu_q), _pairs(cu_k)):
        nq, nk = qb - qa, kb - ka
        if nq == 0 or nk == 0:
            continue
        qs, do, os = (t[qa:qb].double() for t in (q, dout, out))
        ks, vs = (t[ka:kb].double().repeat_interleave(group, 1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        cap_grad = 1.0
        if softcap > 0:
            tanh = torch.tanh(scores / softcap)
            scores, cap_grad = softcap * tanh, 1 - tanh * tanh
        keep = _window_keep(nq, nk, left, right)
        probs = torch.exp(scores - lse_HT[:, qa:qb].double()[..., None]).masked_fill(~keep, 0.0)
        dprobs = torch.einsum("qhd,khd->hqk", do, vs)
        delta = (do * os).sum(-1).T[..., None]
        dscores = probs * (dprobs - delta) * cap_grad * scale
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", dscores, ks)
        dk[ka:kb] = torch.einsum("hqk,qhd->khd", dscores, qs).view(nk, num_kv, group, -1).sum(2)
        dv[ka:kb] = torch.einsum("hqk,qhd->khd", probs, do).view(nk, num_kv, group, -1).sum(2)
    return dq, dk, dv


def _window_keep(num_q, num_k, left, right):
    """(Q, Kn) bool: the keys each query sees, ``left``/``right`` keys around its bottom-right diagonal (-1: all)."""
    diag = torch.arange(num_q)[:, None] + num_k - num_q
    keys = torch.arange(num_k)[None, :]
    keep = torch.ones(num_q, num_k, dtype=torch.bool)
    if right >= 0:
        keep &= keys <= diag + right
    if left >= 0:
        keep &= keys >= diag - left
    return keep


def _pairs(cu):
    bounds = cu.tolist()
    return list(zip(bounds, bounds[1:]))


def _pad8(x):
    return x if x.shape[-1] % 8 == 0 else torch.nn.functional.pad(x, [0, 8 - x.shape[-1] % 8])


def _check_backward(dout, q, k, v, out, dq, dk, dv, head_dim_multiple=8):
    for name, t in (("out", out), ("dout", dout)):
        check(t.dtype == q.dtype, f"query and {name} must have the same dtype")
        check(t.device == q.device, f"{name} must be on CUDA (the device of q)")
        check(t.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
        check(t.shape == q.shape, f"{name} must have shape (total_q, num_heads, head_size)")
    check(q.shape[-1] % head_dim_multiple == 0, "head_size should be a multiple of 8")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if grad is not None:
            check(grad.dtype == q.dtype, f"{name} must have the same dtype as q")
            check(grad.device == q.device, f"{name} must be on CUDA (the device of q)")
            check(grad.stride(-1) == 1, f"{name} must have contiguous last dimension")
            check(grad.shape == like.shape, f"{name} must have the shape of {name[1]}")


def _check_lse(lse, num_heads, total_q):
    check(lse.dtype == torch.float32, "softmax_lse must be float32")
    check(lse.shape == (num_heads, total_q) and lse.is_contiguous(),
          "softmax_lse must be a contiguous (num_heads, total_q) tensor")


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__file__ = f"<fake {name}>"
    module.__dict__.update(attrs)
    return module


# ---------------------------------------------------------------- flash-attn 2.x

def _fa2_varlen_forward_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, pad_in_cpp, padded_lse,
                               softcap=0.0):
    """``mha_varlen_fwd``: out (T, H, D), lse packed (H, T) or padded (B, H, max_seqlen_q)."""
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    head_dim = q.shape[-1]
    if not pad_in_cpp:
        check(head_dim % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    out, lse = attend64(q, k, v, cu_q, cu_k, scale, causal, window, softcap)
    if padded_lse:
        lse = _pack_to_padded(lse, cu_q, max_q)
    return out.to(q.dtype), lse.float()


def _pack_to_padded(lse_HT, cu_q, max_q):
    padded = torch.full((cu_q.numel() - 1, lse_HT.shape[0], max_q), math.inf, dtype=lse_HT.dtype)
    for b, (a, e) in enumerate(_pairs(cu_q)):
        padded[b, :, :e - a] = lse_HT[:, a:e]
    return padded


def _padded_to_pack(lse_BHM, cu_q):
    return torch.cat([lse_BHM[b, :, :e - a] for b, (a, e) in enumerate(_pairs(cu_q))], dim=1)


def _fa2_varlen_backward_kernel(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal,
                                window, padded_lse, softcap=0.0):
    """``mha_varlen_bwd``: fills dq, dk, dv in place; returns softmax_d."""
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    _check_backward(dout, q, k, v, out, dq, dk, dv)
    check(cu_q.numel() > 1, "batch size must be positive")
    if padded_lse:
        check(lse.shape == (cu_q.numel() - 1, q.shape[1], max_q), "softmax_lse must be (b, h, max_seqlen_q)")
        lse = _padded_to_pack(lse, cu_q)
    else:
        _check_lse(lse, q.shape[1], q.shape[0])
    grads = attend_backward64(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, window, softcap)
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    return torch.zeros(q.shape[1], q.shape[0] + 128 * (cu_q.numel() - 1), dtype=torch.float32)


def _maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


_FA2_RELEASES = {"flash_attn-2.5": "2.5.9.post1", "flash_attn-2.6": "2.6.3", "flash_attn-2.8": "2.8.3"}


def _make_fa2(release: str):
    """The modules ``flash_attn`` and ``flash_attn.flash_attn_interface`` of one flash-attn release."""
    version = tuple(int(x) for x in release.split(".")[:2])
    padded_lse = version < (2, 6)
    pad_in_cpp = version < (2, 7)

    if version >= (2, 7):
        forward_op, backward_op = _fa2_custom_ops()
    elif version >= (2, 6):  # 2.6 added softcap after window_size, forward and backward
        def forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False,
                       block_table=None):
            q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
            out, lse = _fa2_varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  softmax_scale, causal, window_size, pad_in_cpp, padded_lse, softcap)
            return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

        def backward_op(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                        alibi_slopes, deterministic, rng_state=None):
            dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
            return _fa2_varlen_backward_kernel(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                               window_size, padded_lse, softcap)
    else:
        def forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size=(-1, -1), alibi_slopes=None, return_softmax=False, block_table=None):
            q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
            out, lse = _fa2_varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  softmax_scale, causal, window_size, pad_in_cpp, padded_lse)
            return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

        def backward_op(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                        alibi_slopes, deterministic, rng_state=None):
            dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
            return _fa2_varlen_backward_kernel(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                               window_size, padded_lse)

    def call_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap):
        if version >= (2, 7):
            return forward_op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal=causal,
                              window_size_left=window[0], window_size_right=window[1], softcap=softcap,
                              alibi_slopes=None, return_softmax=False, block_table=None)
        if version >= (2, 6):
            return forward_op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, window, softcap)
        return forward_op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal, window)

    def call_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, window,
                      softcap):
        if version >= (2, 7):
            return backward_op(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal,
                               window[0], window[1], softcap, None, False, rng_state=None)
        if version >= (2, 6):
            return backward_op(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal,
                               window, softcap, None, False, rng_state=None)
        return backward_op(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, 0.0, scale, causal,
                           window, None, False, rng_state=None)

    class FlashAttnVarlenFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap,
                    return_softmax):
            if softmax_scale is None:
                softmax_scale = q.shape[-1] ** (-0.5)
            head_size_og = q.size(2)
            if not pad_in_cpp:
                q, k, v = (_pad8(x) for x in (q, k, v))
            out_padded, softmax_lse, s_dmask, _ = call_forward(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale,
                                                               causal, window_size, softcap)
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_q, cu_k)
            ctx.args = (max_q, max_k, softmax_scale, causal, window_size, softcap)
            out = out_padded[..., :head_size_og]
            return out if not return_softmax else (out, softmax_lse, s_dmask)

        @staticmethod
        def backward(ctx, dout, *args):
            q, k, v, out, softmax_lse, cu_q, cu_k = ctx.saved_tensors
            max_q, max_k, scale, causal, window, softcap = ctx.args
            head_size_og = dout.size(2)
            q, k, v, out, dout_padded = (_pad8(x) for x in (q, k, v, out, dout))  # the C++ of 2.6 pads too
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            call_backward(dout_padded, q, k, v, out, softmax_lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale,
                          causal, window, softcap)
            return (dq[..., :head_size_og], dk[..., :head_size_og], dv[..., :head_size_og],
                    None, None, None, None, None, None, None, None, None)

    if version >= (2, 6):
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                   block_table=None):
            check(dropout_p == 0.0 and alibi_slopes is None, "the fake supports no dropout")
            return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window_size, softcap, return_attn_probs)
    else:
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                   softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                                   deterministic=False, return_attn_probs=False, block_table=None):
            check(dropout_p == 0.0 and alibi_slopes is None, "the fake supports no dropout")
            return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale, causal, window_size, 0.0, return_attn_probs)

    text = release
    interface = _module("flash_attn.flash_attn_interface", flash_attn_varlen_func=flash_attn_varlen_func,
                        _flash_attn_varlen_forward=forward_op, _flash_attn_varlen_backward=backward_op)
    package = _module("flash_attn", __version__=text, flash_attn_varlen_func=flash_attn_varlen_func,
                      flash_attn_interface=interface)
    package.__path__ = []
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


_CUSTOM_OPS: dict = {}


def _fa2_custom_ops():
    """flash-attn 2.7+'s ``flash_attn::_flash_attn_varlen_forward/backward`` custom ops (made once a process)."""
    if "fa2" in _CUSTOM_OPS:
        return _CUSTOM_OPS["fa2"]

    @torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
    def _flash_attn_varlen_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None, return_softmax: bool = False,
        block_table: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None, zero_tensors: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
        out, lse = _fa2_varlen_forward_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              softmax_scale, causal, (window_size_left, window_size_right),
                                              pad_in_cpp=False, padded_lse=False, softcap=softcap)
        return out, lse, torch.empty(0, dtype=q.dtype), torch.zeros(2, dtype=torch.int64)

    @torch.library.custom_op("flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_varlen_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None,
        dv: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
        max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
        window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None, deterministic: bool,
        rng_state: torch.Tensor | None = None, zero_tensors: bool = False,
    ) -> torch.Tensor:
        dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        return _fa2_varlen_backward_kernel(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                           (window_size_left, window_size_right), padded_lse=False, softcap=softcap)

    _CUSTOM_OPS["fa2"] = (_flash_attn_varlen_forward, _flash_attn_varlen_backward)
    return _CUSTOM_OPS["fa2"]


# ---------------------------------------------------------------- FlashAttention-3 (hopper/)

def _fa3_forward_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap=0.0):
    check(_state["capability"] >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, half_only=False)
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
          "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    check(q.shape[-1] % 8 == 0, "head_size should be a multiple of 8")
    out, lse = attend64(q, k, v, cu_q, cu_k, scale, causal, window, softcap)
    return out.to(q.dtype), lse.float()


def _fa3_backward_kernel(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale, causal, window,
                         softcap=0.0):
    check(cu_q is not None and cu_k is not None, "the fake runs varlen only")
    check_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    _check_backward(dout, q, k, v, out, dq, dk, dv)
    _check_lse(lse, q.shape[1], q.shape[0])
    for target, grad in zip((dq, dk, dv), attend_backward64(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal,
                                                            window, softcap)):
        target.copy_(grad)


def _fa3_custom_backward():
    if "fa3" in _CUSTOM_OPS:
        return _CUSTOM_OPS["fa3"]

    @torch.library.custom_op("flash_attn_3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        softmax_lse: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None, sequed_q: torch.Tensor | None = None,
        sequed_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, dq: torch.Tensor | None = None, dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None, softmax_scale: float | None = None, is_causal: bool = False,
        window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False,
        sm_margin: int = 0,
    ) -> torch.Tensor:
        dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
        dq = torch.empty_like(q) if dq is None else dq
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        _fa3_backward_kernel(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, dq, dk, dv, scale, is_causal, (window_size_left, window_size_right),
                             softcap)
        return torch.zeros(q.shape[1], q.shape[0] + 128 * (cu_seqlens_q.numel() - 1), dtype=torch.float32)

    _CUSTOM_OPS["fa3"] = _flash_attn_backward
    return _flash_attn_backward


def _make_fa3(custom_op: bool):
    if custom_op:
        backward = _fa3_custom_backward()
    else:
        def backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                     max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                     deterministic=False, sm_margin=0):
            dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
            _fa3_backward_kernel(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, dq, dk, dv, softmax_scale, causal, tuple(window_size), softcap)
            return dq, dk, dv, torch.zeros(1)

    def call_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale, causal, window,
                      softcap):
        if custom_op:
            return backward(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max_q, max_k, dq, dk, dv, scale,
                            causal, window[0], window[1], softcap, False, 0)
        return backward(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max_q, max_k, dq, dk, dv, scale, causal,
                        window, softcap, False, 0)

    class FlashAttnVarlenFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap,
                    return_softmax):
            if softmax_scale is None:
                softmax_scale = q.shape[-1] ** (-0.5)
            q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
            out, softmax_lse = _fa3_forward_kernel(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                                                   tuple(window_size), softcap)
            ctx.save_for_backward(q, k, v, out, softmax_lse, cu_q, cu_k)
            ctx.args = (max_q, max_k, softmax_scale, causal, tuple(window_size), softcap)
            return (out, softmax_lse) if return_softmax else out

        @staticmethod
        def backward(ctx, dout, *args):
            q, k, v, out, softmax_lse, cu_q, cu_k = ctx.saved_tensors
            max_q, max_k, scale, causal, window, softcap = ctx.args
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            call_backward(dout.contiguous(), q, k, v, out, softmax_lse, cu_q, cu_k, max_q, max_k, dq, dk, dv, scale,
                          causal, window, softcap)
            return dq, dk, dv, *([None] * 9)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                               softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False):
        # hopper/flash_attn_interface.py: softcap goes to flash_attn_3_cuda.fwd, and _flash_attn_backward passes it
        # on to flash_attn_3_cuda.bwd (both the April 2025 function and the later custom op)
        check(seqused_q is None and seqused_k is None and qv is None and attention_chunk == 0,
              "the fake supports plain varlen attention only")
        return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, window_size, float(softcap), return_attn_probs)

    return {"flash_attn_interface": _module("flash_attn_interface", flash_attn_varlen_func=flash_attn_varlen_func,
                                            _flash_attn_backward=backward)}


# ---------------------------------------------------------------- FlashAttention-4 (flash_attn.cute)

def _fa4_checks(q, k, v, cu_q, cu_k):
    assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
    for t in (cu_q, cu_k):
        assert t is not None and t.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k must be int32"
        assert t.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k must be contiguous"
    assert all(t.device == q.device for t in (k, v, cu_q, cu_k)), "inputs must be on CUDA device"
    assert k.shape[0] == v.shape[0] and k.shape[1:] == v.shape[1:], "k and v must be (total_k, nheads_k, hdim)"
    assert cu_q.shape == cu_k.shape, "cu_seqlens_k must have shape (batch_size + 1,)"
    arch = _state["capability"][0] * 10 + _state["capability"][1]
    assert arch // 10 in [8, 9, 10, 11, 12], "Unsupported compute capability. Supported: 8.x, 9.x, 10.x, 11.x, 12.x"
    assert q.shape[1] % k.shape[1] == 0, "num_head must be divisible by num_head_kv"
    head_dim, alignment = q.shape[-1], 16 // v.element_size()
    if arch // 10 == 9:
        assert 8 <= head_dim <= 256 and head_dim % alignment == 0, f"head_dim {head_dim} is not supported on SM90"
    elif arch // 10 in (10, 11):
        assert (8 <= head_dim <= 128 or head_dim == 256) and head_dim % alignment == 0, (
            f"head_dim {head_dim} is not supported on SM100/SM110")
    return arch


def _make_fa4():
    def _flash_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_size_left, window_size_right, return_lse):
        q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
        _fa4_checks(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        window = (-1 if window_size_left is None else window_size_left,
                  -1 if window_size_right is None else window_size_right)
        out, lse = attend64(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window)
        return out.to(q.dtype), lse.float() if return_lse else None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                        num_threads=256, pack_gqa=False, num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False,
                        dKV_swapAB=False, dQ_swapAB=False, AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2,
                        V_in_regs=False, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                        score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None,
                        block_sparse_tensors=None, dlse=None, learnable_sink=None):
        arch = _fa4_checks(q, k, v, cu_seqlens_q, cu_seqlens_k)
        assert arch // 10 in [9, 10, 11, 12], "Unsupported compute capability. Supported: 9.x, 10.x, 11.x, 12.x"
        q, k, v, out, dout, lse = (_maybe_contiguous(t) for t in (q, k, v, out, dout, lse))
        assert out.shape == q.shape and dout.shape == q.shape, "out and dout must be (total_q, num_head, head_dim_v)"
        assert lse.shape == (q.shape[1], q.shape[0]), "lse must have shape (num_head, total_q)"
        assert q.dtype == out.dtype == dout.dtype, "inputs must have the same dtype"
        assert lse.dtype == torch.float32, "lse must be float32"
        check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        window = (-1 if window_size_left is None else window_size_left,
                  -1 if window_size_right is None else window_size_right)
        # flash_attn/cute/interface.py declares softcap here but hands the kernel None ("softcap - not yet
        # supported in backward"): the gradient is that of attention without the cap, as here
        grads = attend_backward64(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, causal, window)
        return tuple(g.to(q.dtype) for g in grads)

    class FlashAttnVarlenFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, return_lse):
            out, lse = _flash_attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size[0],
                                       window_size[1], True)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
            ctx.args = (max_q, max_k, softmax_scale, causal, window_size)
            ctx.set_materialize_grads(False)
            return out, (lse if return_lse else None)

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
            max_q, max_k, scale, causal, window = ctx.args
            assert dlse is None, "the fake takes no gradient of the LSE"
            dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, scale, causal, window_size_left=window[0],
                                         window_size_right=window[1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                         max_seqlen_q=max_q, max_seqlen_k=max_k)
            return dq, dk, dv, *([None] * 8)

    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                               block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                               scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False):
        assert qv is None and page_table is None and softcap == 0.0, "the fake supports plain varlen attention only"
        return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal, window_size, return_lse)

    interface = _module("flash_attn.cute.interface", flash_attn_varlen_func=flash_attn_varlen_func,
                        _flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)
    cute = _module("flash_attn.cute", flash_attn_varlen_func=flash_attn_varlen_func, interface=interface,
                   __version__="4.0.0b27")
    cute.__path__ = []
    namespace = types.ModuleType("flash_attn")  # flash-attn-4 alone: flash_attn/ has no __init__.py
    namespace.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    namespace.__path__ = []
    namespace.cute = cute
    return {"flash_attn": namespace, "flash_attn.cute": cute, "flash_attn.cute.interface": interface}


# ---------------------------------------------------------------- torch's varlen ops (aten flash kernels)

def _aten_flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                        return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                        seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    check(_state["capability"] >= (8, 0), "FlashAttention only supports Ampere GPUs or newer.")
    check(cum_seq_q is not None and cum_seq_k is not None, "the fake runs the varlen path only")
    check(dropout_p == 0.0 and not return_debug_mask, "the fake supports no dropout")
    check_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    check(query.shape[-1] % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    window = (-1 if window_size_left is None else window_size_left,
              -1 if window_size_right is None else window_size_right)
    out, lse = attend64(query, key, value, cum_seq_q, cum_seq_k, scale, is_causal, window)
    empty = torch.empty(0, dtype=query.dtype)
    return out.to(query.dtype), lse.float(), torch.zeros(2, dtype=torch.uint64), torch.empty(0), empty


def _aten_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                         window_size_right=None):
    check_varlen(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
    _check_backward(grad_out, query, key, value, out, None, None, None)
    _check_lse(logsumexp, query.shape[1], query.shape[0])
    check(dropout_p == 0.0, "the fake supports no dropout")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    window = (-1 if window_size_left is None else window_size_left,
              -1 if window_size_right is None else window_size_right)
    grads = attend_backward64(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, scale,
                              is_causal, window)
    return tuple(g.to(query.dtype) for g in grads)


def _install_torch_varlen():
    import torch.nn.attention.varlen  # noqa: F401 - registers the torch_attn ops

    library = torch.library.Library("aten", "IMPL")
    library.impl("_flash_attention_forward", _aten_flash_forward, "CPU")
    library.impl("_flash_attention_backward", _aten_flash_backward, "CPU")
    return library


# ---------------------------------------------------------------- installing

def install(*names: str, capability: tuple[int, int] = (9, 0), broken: dict | None = None):
    """Make ``names`` the installed GPU attention libraries on a device of ``capability``; returns undo().

    ``broken``: module name -> exception raised on import (a wheel built for another torch, say).
    """
    unknown = [n for n in names if n not in FAKES]
    if unknown:
        raise ValueError(f"unknown fakes {unknown}")
    saved = {m: sys.modules.get(m) for m in LIBRARY_MODULES}
    saved_capability, saved_state = kernels._device_capability, dict(_state)
    modules: dict = dict.fromkeys(LIBRARY_MODULES)  # None in sys.modules: "not installed"
    if "fa4" in names:
        modules.update(_make_fa4())
    for name in names:
        if name.startswith("flash_attn-"):  # a real flash_attn package (FA4, when there, is its cute/)
            modules.update(_make_fa2(_FA2_RELEASES[name]))
            if "fa4" in names:
                modules["flash_attn"].cute = modules["flash_attn.cute"]
        elif name.startswith("fa3"):
            modules.update(_make_fa3(custom_op=name == "fa3"))
    for module, error in (broken or {}).items():
        modules[module] = _Broken(module, error)
    library = _install_torch_varlen() if "torch_varlen" in names else None
    for module, value in modules.items():
        if isinstance(value, _Broken):
            sys.modules.pop(module, None)
            sys.meta_path.insert(0, value)
        else:
            sys.modules[module] = value
    _state["capability"] = capability
    kernels._device_capability = lambda device: _state["capability"]
    _reset_caches()

    def undo():
        for value in modules.values():
            if isinstance(value, _Broken) and value in sys.meta_path:
                sys.meta_path.remove(value)
        for module, value in saved.items():
            if value is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = value
        if library is not None:
            library._destroy()
        kernels._device_capability = saved_capability
        _state.update(saved_state)
        _reset_caches()

    return undo


def _reset_caches():
    kernels._load.cache_clear()
    parameters.cache_clear()
    kernels._warned.clear()


class _Broken(importlib.abc.MetaPathFinder):
    """A package that is there but fails to import (finds the module, raises on loading it)."""

    def __init__(self, module: str, error: Exception):
        self.module, self.error = module, error

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=f"<broken {fullname}>")

    def create_module(self, spec):
        raise self.error

    def exec_module(self, module):
        raise self.error
