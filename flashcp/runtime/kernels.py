"""Variable-length causal attention kernels: ``flash_attn``, ``torch_varlen`` and a pure-torch ``reference``.

This is the only module that imports ``flash_attn`` (lazily, on first use). Every backend computes the same
thing: for each sequence ``i`` of a packed batch, the queries ``q[cu_q[i]:cu_q[i+1]]`` attend to the keys
``k[cu_k[i]:cu_k[i+1]]`` with a *bottom-right aligned* causal mask. A query shard ``[start, start+n)`` of a
document therefore attends to the key prefix ``[0, start+n)``: query ``j`` sees keys ``0 .. start+j``. Every
sequence needs at least as many keys as queries.

Shape legend: ``T`` packed query tokens, ``S`` packed key tokens, ``H`` query heads, ``K`` key/value heads
(``H % K == 0``; grouped-query attention when ``K < H``), ``D`` head dim, ``B`` sequences in the batch.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F

from flashcp.errors import FlashcpError

__all__ = ["BACKENDS", "BackendUnavailableError", "backend_available", "resolve_backend", "varlen_attention"]

BACKENDS = ("flash_attn", "torch_varlen", "reference")
"""Kernel backends in the order ``"auto"`` tries them."""

_HALF_DTYPES = (torch.float16, torch.bfloat16)


class BackendUnavailableError(FlashcpError):
    """The requested attention backend cannot run on these tensors (not installed, wrong device or dtype)."""


@functools.cache
def _flash_attn_func():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


@functools.cache
def _torch_varlen_func():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    params = inspect.signature(varlen_attn).parameters
    # The causal flag moved between torch releases: ``is_causal=True`` in early versions,
    # ``window_size=(-1, 0)`` later. Both select the same bottom-right aligned flash kernel.
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None, {}
    return varlen_attn, {"causal": causal, "enable_gqa": "enable_gqa" in params, "scale": "scale" in params}


def _why_unavailable(backend: str, q: torch.Tensor) -> str | None:
    """None when ``backend`` can run on tensors like ``q``, else the reason in a few words."""
    if backend == "reference":
        return None
    if backend not in BACKENDS:
        return f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)} or auto)"
    if not q.is_cuda:
        return f"{backend} needs CUDA tensors, got {q.device.type}"
    if q.dtype not in _HALF_DTYPES:
        return f"{backend} needs float16 or bfloat16, got {q.dtype}"
    if backend == "flash_attn" and _flash_attn_func() is None:
        return "flash_attn is not installed (pip install flash-attn)"
    if backend == "torch_varlen" and _torch_varlen_func()[0] is None:
        return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
    return None


def backend_available(backend: str, q: torch.Tensor) -> bool:
    """Whether ``backend`` can run on tensors like ``q`` (device, dtype, installed packages)."""
    return _why_unavailable(backend, q) is None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend for ``backend`` (``"auto"`` takes the first of BACKENDS that can run on ``q``).

    Raises BackendUnavailableError naming the reason when an explicitly requested backend cannot run.
    """
    if backend == "auto":
        return next(b for b in BACKENDS if backend_available(b, q))
    why = _why_unavailable(backend, q)
    if why is not None:
        raise BackendUnavailableError(f"attention backend '{backend}' cannot run here: {why}")
    return backend


def varlen_attention(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, backend: str = "auto",
                     softmax_scale: float | None = None) -> torch.Tensor:
    """Bottom-right causal attention over packed variable-length sequences; returns ``out_THD``.

    Args:
        q_THD: queries, (T, H, D).
        k_SKD: keys, (S, K, D), same dtype and device; ``H % K == 0``.
        v_SKD: values, (S, K, D).
        cu_seqlens_q: (B + 1,) int32 offsets of each sequence's queries in ``q_THD``, on q's device.
        cu_seqlens_k: (B + 1,) int32 offsets of each sequence's keys in ``k_SKD``; every sequence has at least
            as many keys as queries.
        max_seqlen_q: longest query sequence.
        max_seqlen_k: longest key sequence.
        backend: one of BACKENDS or ``"auto"``.
        softmax_scale: the factor applied to ``q . k`` before the softmax; None means ``1 / sqrt(D)``.

    Differentiable in q, k and v with every backend.
    """
    backend = resolve_backend(backend, q_THD)
    if q_THD.shape[0] == 0:
        return q_THD.clone()
    if backend == "flash_attn":
        return _flash_attn_func()(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=True)
    if backend == "torch_varlen":
        varlen_attn, options = _torch_varlen_func()
        kwargs = dict(options["causal"])
        if k_SKD.shape[1] != q_THD.shape[1] and options["enable_gqa"]:
            kwargs["enable_gqa"] = True
        if softmax_scale is not None:
            if options["scale"]:
                kwargs["scale"] = softmax_scale
            else:  # releases without a scale argument: fold the ratio to the default scale into q
                q_THD = q_THD * (softmax_scale * math.sqrt(q_THD.shape[-1]))
        return varlen_attn(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           **kwargs)
    return reference_varlen_attention(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, softmax_scale)


def reference_varlen_attention(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               softmax_scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` one sequence at a time with an explicit bottom-right causal mask.

    Runs on any device and dtype (float64 included); loops over sequences: for CPU, tests and checks.
    ``softmax_scale`` None means ``1 / sqrt(D)``.
    """
    scale = 1.0 / math.sqrt(q_THD.shape[-1]) if softmax_scale is None else float(softmax_scale)
    num_heads, num_kv_heads = q_THD.shape[1], k_SKD.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of key/value heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for i in range(len(cu_q) - 1):
        num_q, num_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if num_k < num_q:
            raise ValueError(f"sequence {i} has {num_q} queries but only {num_k} keys")
        q_HQD = q_THD[cu_q[i]:cu_q[i + 1]].transpose(0, 1)
        k_HKD = k_SKD[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        v_HKD = v_SKD[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(group, dim=0)
        # bottom-right alignment: query j is the (num_k - num_q + j)-th key position
        keep_QK = (torch.arange(num_k, device=q_THD.device)[None, :]
                   <= torch.arange(num_q, device=q_THD.device)[:, None] + (num_k - num_q))
        out_HQD = F.scaled_dot_product_attention(q_HQD, k_HKD, v_HKD, attn_mask=keep_QK, scale=scale)
        outs.append(out_HQD.transpose(0, 1))
    return torch.cat(outs) if outs else q_THD.new_zeros(q_THD.shape)
