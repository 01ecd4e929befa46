"""FlashAttention-4: ``flash_attn.cute`` (the ``flash-attn-4`` package), compute capability 9.0 or newer.

``flash_attn_varlen_func`` takes ``qv`` as its fourth positional parameter and always returns ``(out, lse)``;
the block-wise backward is ``flash_attn.cute.interface._flash_attn_bwd``. On Blackwell (10.x, 11.x) it takes
head dims up to 128, or exactly 256. Its forward takes a soft-cap, but ``_flash_attn_bwd`` hands its kernel
None for it ("softcap - not yet supported in backward", flash_attn/cute/interface.py): the gradient would be
that of uncapped attention, so flashcp refuses soft-capping on FA4 and ``auto`` takes FA3 or FA2.
"""

from __future__ import annotations

from typing import Any

from flashcp.runtime.kernels import library
from flashcp.runtime.kernels.library import Api, Library

__all__ = ["FA4"]


def _load() -> Api:
    cute = library.import_module("flash_attn.cute", "flash-attn-4")
    interface = library.import_module("flash_attn.cute.interface", "flash-attn-4")
    backward = getattr(interface, "_flash_attn_bwd", None)
    varlen = library.attribute(cute, "flash_attn_varlen_func")
    return Api(attention=varlen, forward=varlen, backward=backward,
               why_not_blockwise=None if backward is not None else "flash_attn.cute.interface has no _flash_attn_bwd")


def _head_dims(capability: tuple[int, int] | None, head_dim: int) -> bool:
    if capability is not None and capability[0] in (10, 11):  # Blackwell: up to 128, or exactly 256
        return head_dim <= 128 or head_dim == 256
    return library.up_to_256(capability, head_dim)


def _forward(api: Api, q_TPH, k_SKP, v_SKP, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
             left, softcap):
    options: dict[str, Any] = {} if softcap is None else {"softcap": float(softcap)}
    if left >= 0:
        options["window_size"] = (left, 0)
    return api.attention(q_TPH, k_SKP, v_SKP, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale, causal=causal,
                         return_lse=True, **options)


def _backward(api: Api, dout, q, k, v, out, lse_HT, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              causal, scale, left, softcap):
    # FA4 spells an infinite window None and derives the causal one from ``causal``
    window = {} if left < 0 else {"window_size_left": left, "window_size_right": 0}
    grads = library.call(api.backward, [], {
        **window, "q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse_HT, "softmax_scale": scale,
        "causal": causal, "softcap": softcap, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
        "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "deterministic": False})
    return grads[0], grads[1], grads[2]


FA4 = Library(
    name="fa4", load=_load, min_capability=(9, 0), dtypes=library.HALF_DTYPES, head_dims=_head_dims,
    kinds=frozenset({"window"}), kinds_declared=True, auto_majors=(9, None),
    withheld=(("softcap", "its _flash_attn_bwd ignores softcap (flash_attn/cute/interface.py passes the kernel "
                          "None), so the gradient would be wrong"),),
    attention=library.pad_attention(library.flash_attention), forward=library.pad_forward("fa4", _forward),
    backward=library.pad_backward(_backward))
"""FlashAttention-4; ``"auto"`` tries it on Hopper after FA3, first on Blackwell and newer."""
