"""Attention layer kinds beyond full causal attention: sliding windows, chunks, learned sinks, soft-capping.

A ``LayerKind`` narrows or reshapes one layer's document-causal attention, as today's open models do:

- ``window`` W (Mistral, Gemma 2/3, gpt-oss): a token at position p of its document sees positions
  ``(p - W, p]``, itself and the W-1 before it (transformers' ``sliding_window``: ``kv_idx > q_idx - W``);
- ``chunk`` K (Llama 4): it sees ``[K * floor(p / K), p]``, its own chunk of the document;
- ``softcap`` c (Gemma 2): scores ``c * tanh(s / c)``, ``s`` the scaled ``q . k``, before the mask.

Learned sinks (gpt-oss) are an (H,) tensor of per-head logits added to every query's softmax denominator: a
key of value zero that every query sees. With ``lse`` the log-sum-exp over the keys,
``out = out_plain * sigmoid(lse - sink)``; they are an argument apart from the kind since they are trained.

``kind_attention`` runs any of them through the log-sum-exp entry points of ``flashcp.runtime.kernels`` in an
autograd Function. The sinks are applied from the log-sum-exp, so they work on every backend: the backward
hands the kernel the sinked output and ``lse' = logaddexp(lse, sink)``, with which its ``P = exp(S - lse')``
and ``rowsum(dO * O)`` are exactly the softmax gradient over the keys and the sink; ``d sink =
-sum(dO * O) * exp(sink - lse')``.

The kernels align a window bottom-right (the last query of a sequence sees the last key, flash-attn's
convention when a sequence has more keys than queries), so a key sequence may start anywhere before its
queries: ``cp_attention`` gives each shard only the keys its kind sees (``CPAttnMeta.for_kind``). A chunk
needs the key's position mod K: the kernels count positions from each key sequence's first key, so a chunk
layer's key sequences start at chunk boundaries, or, as ``cp_attention`` runs them, are split at chunk
boundaries beforehand so that the kernels see no chunk at all.

Shape legend: ``T`` packed query tokens, ``S`` packed key tokens, ``H`` query heads, ``K`` key/value heads,
``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashcp.runtime.kernels import fold_softmax_scale, varlen_attention_backward, varlen_attention_forward

__all__ = ["LayerKind", "check_sinks", "kind_attention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKind:
    """What one attention layer computes beside the document-causal mask (all None: full causal attention)."""

    window: int | None = None
    """Sliding window in tokens, the query included: a token sees itself and the ``window - 1`` before it."""
    chunk: int | None = None
    """Chunk length in tokens: a token sees the tokens of its document's chunk up to itself."""
    softcap: float | None = None
    """Logit soft-cap c: scores ``c * tanh(s / c)`` before the mask."""

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
                raise ValueError(f"{name} must be a positive number of tokens or None, got {value!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be a positive number or None, got {self.softcap!r}")

    @property
    def plain(self) -> bool:
        """Whether this is full causal attention (no window, chunk or soft-cap)."""
        return self.window is None and self.chunk is None and self.softcap is None

    def kernel_args(self) -> dict[str, Any]:
        """``window``, ``chunk``, ``softcap`` as the kernels' keyword arguments."""
        return {"window": None if self.window is None else int(self.window),
                "chunk": None if self.chunk is None else int(self.chunk),
                "softcap": None if self.softcap is None else float(self.softcap)}


def check_sinks(sinks_H: torch.Tensor | None, num_heads: int) -> None:
    """Raise ValueError unless ``sinks_H`` is None or an (H,) floating tensor."""
    if sinks_H is None:
        return
    if sinks_H.shape != (num_heads,) or not sinks_H.is_floating_point():
        raise ValueError(f"sinks must be a floating (H,) = ({num_heads},) tensor of per-head logits, got "
                         f"{sinks_H.dtype} {tuple(sinks_H.shape)}")


def kind_attention(q_THD: torch.Tensor, k_SKD: torch.Tensor, v_SKD: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *, kind: LayerKind,
                   sinks_H: torch.Tensor | None = None, backend: str = "reference",
                   softmax_scale: float | None = None) -> torch.Tensor:
    """Document-causal attention of one layer kind with optional sinks; returns ``out_THD``.

    Args:
        q_THD: queries, (T, H, D).
        k_SKD: keys, (S, K, D), q's dtype; each sequence a document prefix from its first token.
        v_SKD: values, (S, K, D).
        cu_seqlens_q: (B + 1,) int32 query offsets, as in ``kernels.varlen_attention``.
        cu_seqlens_k: (B + 1,) int32 key offsets.
        max_seqlen_q: longest query sequence.
        max_seqlen_k: longest key sequence.
        kind: the layer's window, chunk and soft-cap.
        sinks_H: (H,) per-head sink logits, or None.
        backend: a concrete backend that runs ``kind`` (``resolve_backend(..., blockwise=True, **kind)``).
        softmax_scale: the factor on ``q . k`` before the soft-cap and softmax; None means ``1 / sqrt(D)``.

    Differentiable in q, k, v and the sinks.
    """
    check_sinks(sinks_H, q_THD.shape[1])
    q_THD = fold_softmax_scale(q_THD, softmax_scale)  # the log-sum-exp entry points use 1/sqrt(D)
    if q_THD.shape[0] == 0:
        return q_THD.clone() if sinks_H is None else q_THD + 0 * sinks_H.sum()
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _KindAttention.apply(q_THD, k_SKD, v_SKD, sinks_H, lengths, kind, backend)


class _KindAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_SKD, v_SKD, sinks_H, lengths, kind: LayerKind, backend: str):
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = lengths
        out_THD, lse_TH = varlen_attention_forward(q_THD, k_SKD, v_SKD, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, causal=True, backend=backend, **kind.kernel_args())
        if sinks_H is not None:
            lse_sinked = torch.logaddexp(lse_TH, sinks_H.to(lse_TH.dtype)[None, :])
            out_THD = (out_THD.to(lse_TH.dtype) * torch.exp(lse_TH - lse_sinked)[..., None]).to(q_THD.dtype)
            lse_TH = lse_sinked
        ctx.save_for_backward(q_THD, k_SKD, v_SKD, out_THD, lse_TH, sinks_H)
        ctx.lengths, ctx.kind, ctx.backend = lengths, kind, backend
        return out_THD

    @staticmethod
    def backward(ctx, grad_out_THD):
        q_THD, k_SKD, v_SKD, out_THD, lse_TH, sinks_H = ctx.saved_tensors
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = ctx.lengths
        dq, dk, dv = varlen_attention_backward(grad_out_THD, q_THD, k_SKD, v_SKD, out_THD, lse_TH, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
                                               backend=ctx.backend, **ctx.kind.kernel_args())
        dsinks = None
        if sinks_H is not None and ctx.needs_input_grad[3]:
            acc = lse_TH.dtype
            delta_TH = (grad_out_THD.to(acc) * out_THD.to(acc)).sum(-1)
            dsinks = -(delta_TH * torch.exp(sinks_H.to(acc)[None, :] - lse_TH)).sum(0).to(sinks_H.dtype)
        return dq, dk, dv, dsinks, None, None, None
