"""``CPAttention``: ``cp_attention`` bound to one batch's meta, the callable a model attends with.

A model's attention layers call ``attn(q_THD, k_TKD, v_TKD)`` without knowing about plans or process groups;
``train_step`` builds one per step (``CPAttention(meta=batch.attn, group=..., comm=..., backend=...)``) and
the integrations hand it to transformers' and torchtitan's attention (``flashcp.integrations``).

Shape legend: ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashcp.runtime.attention import cp_attention
from flashcp.runtime.comm import CommStats
from flashcp.runtime.meta import CPAttnMeta

__all__ = ["CPAttention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CPAttention:
    """``cp_attention`` bound to one batch's meta: ``attn(q_THD, k_TKD, v_TKD) -> out_THD``."""

    meta: CPAttnMeta
    """This rank's meta for the sequence (``batch.attn``)."""
    group: Any = None
    """The CP process group (None: the default group)."""
    comm: str = "auto"
    """``allgather``, ``a2a``, ``full`` or ``auto``."""
    backend: str = "auto"
    """``fa3``, ``fa4``, ``flash_attn``, ``torch_varlen``, ``reference`` or ``auto``."""
    stats: CommStats | None = None
    """Records every collective issued, or None."""

    def __call__(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                 softmax_scale: float | None = None, *, window: int | None = None, chunk: int | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries (T, H, D) over keys/values (T, K, D); returns (T, H, D).

        ``window``, ``chunk``, ``sinks`` (H,) and ``softcap``: the layer's kind, as ``cp_attention`` takes them.
        """
        return cp_attention(q_THD, k_TKD, v_TKD, self.meta, group=self.group, comm=self.comm,
                            backend=self.backend, stats=self.stats, softmax_scale=softmax_scale, window=window,
                            chunk=chunk, sinks=sinks, softcap=softcap)
