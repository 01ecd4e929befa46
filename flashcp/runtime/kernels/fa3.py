"""FlashAttention-3: ``flash_attn_interface``, built from flash-attention's ``hopper/`` folder.

Its backward ``_flash_attn_backward`` is a ``torch.library.custom_op`` from July 2025 on (``is_causal``,
``window_size_left/right``), a plain function before (``causal``, ``window_size``). Its forward takes a
soft-cap, which both backwards pass on to ``flash_attn_3_cuda.bwd`` (hopper/flash_attn_interface.py), so
flashcp runs soft-capped layers on it; and ``attention_chunk``, which no backward takes, so chunks run split
into plain causal sequences (``kernels.varlen_attention_forward``).
"""

from __future__ import annotations

import torch

from flashcp.runtime.kernels import library
from flashcp.runtime.kernels.library import Api, BackendUnavailableError, Library

__all__ = ["FA3"]


def _load() -> Api:
    interface = library.import_module("flash_attn_interface", "FlashAttention-3 (built from flash-attention's hopper/)")
    backward = getattr(interface, "_flash_attn_backward", None)
    varlen = library.attribute(interface, "flash_attn_varlen_func")
    return Api(attention=varlen, forward=varlen, backward=backward,
               why_not_blockwise=None if backward is not None else "flash_attn_interface has no _flash_attn_backward")


def _backward(api: Api, dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, scale, left, softcap):
    if not {"dq", "dk", "dv"} <= set(library.parameters(api.backward)):
        raise BackendUnavailableError("flash_attn_interface._flash_attn_backward takes no dq, dk, dv buffers")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # the custom op (2025-07 on) says is_causal and window_size_left/right; earlier builds causal, window_size
    library.call(api.backward, [], {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse_HT, "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k, "sequed_q": None, "sequed_k": None, "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k, "dq": dq, "dk": dk, "dv": dv, "softmax_scale": scale, "causal": causal,
        "is_causal": causal, "window_size": (left, 0) if causal else (-1, -1), "window_size_left": left,
        "window_size_right": 0 if causal else -1, "softcap": softcap, "deterministic": False, "sm_margin": 0})
    return dq, dk, dv


FA3 = Library(
    name="fa3", load=_load, min_capability=(8, 0), dtypes=library.HALF_DTYPES, head_dims=library.up_to_256,
    kinds=frozenset({"window", "softcap"}), kinds_declared=True, auto_majors=(9, 9),
    attention=library.pad_attention(library.flash_attention),
    forward=library.pad_forward("fa3", library.probs_forward("fa3")), backward=library.pad_backward(_backward))
"""FlashAttention-3; ``"auto"`` tries it on Hopper (9.x) only."""
