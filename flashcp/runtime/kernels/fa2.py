"""FlashAttention-2: ``flash_attn.flash_attn_varlen_func`` (``flash-attn`` 2.6 or newer for block-wise attention).

Block-wise attention calls ``flash_attn_interface._flash_attn_varlen_backward``, whose parameters moved between
releases (``window_size`` -> ``window_size_left/right``, ``softcap``, ``zero_tensors``; a
``torch.library.custom_op`` from 2.7 on). flash-attn 2.5 and older return a padded ``(B, H, max_seqlen)``
log-sum-exp, so they run the differentiable attention only.
"""

from __future__ import annotations

import torch

from flashcp.runtime.kernels import library
from flashcp.runtime.kernels.library import Api, Library, Unavailable

__all__ = ["FLASH_ATTN"]


def _load() -> Api:
    package = library.import_module("flash_attn", "flash-attn")
    if getattr(package, "__file__", None) is None:  # a namespace package: only flash-attn-4 is installed
        raise Unavailable("flash-attn (FlashAttention-2) is not installed", installed=False)
    interface = library.import_module("flash_attn.flash_attn_interface", "flash-attn")
    version = str(getattr(package, "__version__", "0"))
    why = None
    if library.version_of(version) < (2, 6):
        why = (f"flash-attn {version} returns the padded (B, H, max_seqlen) log-sum-exp; block-wise attention "
               f"needs 2.6 or newer (pip install -U flash-attn)")
    backward = getattr(interface, "_flash_attn_varlen_backward", None)
    if backward is None and why is None:
        why = f"flash-attn {version} has no flash_attn_interface._flash_attn_varlen_backward"
    varlen = library.attribute(package, "flash_attn_varlen_func")
    return Api(attention=varlen, forward=varlen, backward=backward, why_not_blockwise=why)


def _backward(api: Api, dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, scale, left, softcap):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    library.call(api.backward, [], {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": lse_HT, "dq": dq, "dk": dk, "dv": dv,
        "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
        "max_seqlen_k": max_seqlen_k, "dropout_p": 0.0, "softmax_scale": scale, "causal": causal,
        "window_size": (left, 0) if causal else (-1, -1), "window_size_left": left,
        "window_size_right": 0 if causal else -1, "softcap": softcap, "alibi_slopes": None,
        "deterministic": False, "rng_state": None, "zero_tensors": False})
    return dq, dk, dv


FLASH_ATTN = Library(
    name="flash_attn", load=_load, min_capability=(8, 0), dtypes=library.HALF_DTYPES, head_dims=library.up_to_256,
    kinds=frozenset({"window", "softcap"}), kinds_declared=True, auto_majors=(0, None),
    attention=library.pad_attention(library.flash_attention),
    forward=library.pad_forward("flash_attn", library.probs_forward("flash_attn")),
    backward=library.pad_backward(_backward))
"""FlashAttention-2; windows and soft-caps from 2.6 on."""
