"""torch's varlen attention: ``torch.nn.attention.varlen.varlen_attn`` and its ``torch_attn`` ops.

The causal flag of ``varlen_attn`` moved between torch releases (``is_causal=True`` early, ``window_size=(-1,
0)`` later), and releases without a ``scale`` argument apply ``1/sqrt(P)``. Block-wise attention calls the ops
``torch_attn::_varlen_attn`` and ``torch_attn::_varlen_attn_backward``, which return and take the packed
``(H, T)`` log-sum-exp.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from flashcp.runtime.kernels import library
from flashcp.runtime.kernels.library import Api, Library, Unavailable

__all__ = ["TORCH_VARLEN"]


def _load() -> Api:
    varlen = library.import_module("torch.nn.attention.varlen", f"torch {torch.__version__} varlen attention")
    varlen_attn = library.attribute(varlen, "varlen_attn")
    ops = torch.ops.torch_attn
    why = None
    if not (hasattr(ops, "_varlen_attn") and hasattr(ops, "_varlen_attn_backward")):
        why = f"torch {torch.__version__} lacks the torch_attn varlen ops block-wise attention calls"
    params = inspect.signature(varlen_attn).parameters
    # the causal flag moved between torch releases: is_causal=True early, window_size=(-1, 0) later
    if "window_size" not in params and "is_causal" not in params:
        raise Unavailable(f"torch {torch.__version__} varlen_attn takes neither window_size nor is_causal",
                          installed=True)
    if why is not None:
        return Api(attention=varlen_attn, forward=None, backward=None, why_not_blockwise=why)
    return Api(attention=varlen_attn, forward=ops._varlen_attn, backward=ops._varlen_attn_backward,
               why_not_blockwise=None)


def _attend(api: Api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scale: float) -> torch.Tensor:
    params = library.parameters(api.attention)
    kwargs: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k_SKP.shape[1] != q_TPH.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # releases without a scale argument apply 1/sqrt(P)
        q_TPH = q_TPH * (scale * math.sqrt(q_TPH.shape[-1]))
    return api.attention(q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def _forward(api: Api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
             left, softcap):
    lengths = [cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k]
    out, lse, _ = library.call(api.forward, [q_TPH, k_SKP, v_SKP, *lengths],
                               {"is_causal": causal, "scale": scale, "window_size": [left, 0] if causal else [-1, -1],
                                "enable_gqa": k_SKP.shape[1] != q_TPH.shape[1],
                                "softcap": 0.0 if softcap is None else float(softcap)})
    return out, lse


def _backward(api: Api, dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, scale, left, softcap):
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout
    return library.call(api.backward,
                [dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 rng_state], {"scale": scale, "window_size": [left, 0] if causal else [-1, -1], "softcap": softcap})


TORCH_VARLEN = Library(
    name="torch_varlen", load=_load, min_capability=(8, 0), dtypes=library.HALF_DTYPES, head_dims=library.up_to_256,
    kinds=frozenset({"window", "softcap"}), kinds_declared=True, auto_majors=(0, None),
    attention=library.pad_attention(_attend), forward=library.pad_forward("torch_varlen", _forward),
    backward=library.pad_backward(_backward))
"""torch's varlen attention; windows, and soft-caps once its ops declare them (no release does yet)."""
