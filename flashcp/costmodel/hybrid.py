"""Hybrid models (recurrent layers beside attention) and the bytes one training step exchanges for a plan.

A step is every layer's forward and backward. Per layer and pass:

- attention layers: the exact-need K/V exchange (``comm.exchange_volumes``: rows each rank sends and
  receives) at ``2 H_kv D`` elements per row in the K/V dtype; the backward sends dK/dV back along the same
  rows in the same dtype (``a2a``), so it moves as many bytes;
- recurrent layers: the all-to-alls of state maps and convolution inputs (``recurrent.recurrent_exchange``:
  each map to the other ranks holding a later piece of its document, each input token to the other ranks
  holding a piece within ``W - 1`` after it); the backward's reversed all-to-alls move the same bytes the other
  way.

So a step moves twice the forward's bytes. The busiest rank is the one with the most bytes on one side of its
links (``max(sent, received)``, links being full duplex); the total is what all ranks send.

Published shapes, as named constants with their source: ``QWEN3_NEXT_80B_A3B`` (transformers 5.24's
``Qwen3NextConfig()`` defaults, which are the published Qwen/Qwen3-Next-80B-A3B config) and ``NEMOTRON_H_8B``
(nvidia/Nemotron-H-8B-Base-8K: Megatron-Bridge's ``NemotronHModelProvider8B`` and its base
``NemotronHModelProvider``; transformers 5.24's ``NemotronHConfig()`` defaults have the same Mamba and attention
shapes but a 4-layer pattern).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashcp.costmodel.comm import exchange_volumes
from flashcp.costmodel.models import BUILTIN_MODELS, ModelSpec
from flashcp.costmodel.recurrent import RecurrentShape, recurrent_exchange
from flashcp.costmodel.shape import AttentionShape

__all__ = ["NEMOTRON_H_8B", "QWEN3_NEXT_80B_A3B", "HybridModel", "StepBytes", "step_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HybridModel:
    """A hybrid model's token-mixing layers as CP exchanges them (MLP and MoE layers exchange nothing)."""

    name: str
    """The published model."""
    recurrent: RecurrentShape
    """Its recurrent layers (their count in ``recurrent.num_layers``)."""
    num_attention_layers: int
    """Full-attention layers."""
    num_heads: int
    """H: query heads of an attention layer."""
    num_kv_heads: int
    """H_kv: key/value heads of an attention layer."""
    head_dim: int
    """D: attention head dim."""
    kv_bytes: int = 2
    """Bytes per K/V element on the wire (bf16)."""

    def __post_init__(self):
        for name in ("num_heads", "num_kv_heads", "head_dim", "kv_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_attention_layers < 0:
            raise ValueError(f"num_attention_layers must be at least 0, got {self.num_attention_layers}")

    @classmethod
    def of(cls, spec: ModelSpec, name: str | None = None) -> HybridModel:
        """The hybrid of a ``ModelSpec`` with recurrent layers (its attention layers all full)."""
        if spec.recurrent is None or any(layer.kind != "full" for layer in spec.layers):
            raise ValueError(f"model {spec.name} is not a hybrid with full attention layers")
        return cls(name=name or spec.name, recurrent=spec.recurrent, num_attention_layers=len(spec.layers),
                   num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)

    @property
    def num_mixing_layers(self) -> int:
        """Attention plus recurrent layers: the layers of the all-attention twin."""
        return self.num_attention_layers + self.recurrent.num_layers

    def attention_shape(self) -> AttentionShape:
        """The shape its plans are priced for: its attention layers and, beside them, its recurrent layers."""
        return AttentionShape(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              layers=self.num_attention_layers, dtype_bytes=self.kv_bytes, recurrent=self.recurrent)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's K and V in one layer: ``2 H_kv D kv_bytes``."""
        return 2 * self.num_kv_heads * self.head_dim * self.kv_bytes


QWEN3_NEXT_80B_A3B = HybridModel.of(BUILTIN_MODELS["qwen3-next-80b-a3b"], "Qwen3-Next-80B-A3B")
"""Qwen/Qwen3-Next-80B-A3B: the built-in model (transformers 5.24 ``Qwen3NextConfig()`` defaults)."""

NEMOTRON_H_8B = HybridModel(
    name="Nemotron-H-8B",
    # hybrid_override_pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-": 24 Mamba-2, 4 attention,
    # 24 MLP; mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4
    recurrent=RecurrentShape(kind="ssd", num_heads=128, key_dim=128, value_dim=64, num_groups=8, conv_width=4,
                             num_layers=24),
    # num_attention_heads 32, num_key_value_heads 8, head_dim 128
    num_attention_layers=4, num_heads=32, num_kv_heads=8, head_dim=128,
)
"""nvidia/Nemotron-H-8B-Base-8K (Megatron-Bridge ``NemotronHModelProvider8B``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBytes:
    """Bytes one training step (forward and backward, every layer) exchanges for one plan."""

    hybrid_busiest: int
    """The hybrid model's busiest rank: the most bytes on one side of one rank's links."""
    hybrid_total: int
    """The hybrid model, all ranks' sent bytes."""
    attention_busiest: int
    """The all-attention twin (every mixing layer full attention, exact-need K/V): busiest rank."""
    attention_total: int
    """The all-attention twin: all ranks' sent bytes."""
    recurrent_total: int
    """The part of ``hybrid_total`` the recurrent layers move (maps and convolution inputs)."""


def step_bytes(model: HybridModel, shard_doc, shard_start, shard_len, shard_rank, cp: int) -> StepBytes:
    """Bytes per step of ``model`` and of its all-attention twin for one plan (module docstring)."""
    volumes = exchange_volumes(shard_doc, shard_start, shard_len, shard_rank, cp)
    kv_sent = np.asarray(volumes.sent, dtype=np.int64) * model.kv_row_bytes
    kv_received = np.asarray(volumes.received, dtype=np.int64) * model.kv_row_bytes
    recurrent = recurrent_exchange(model.recurrent, shard_doc, shard_start, shard_len, shard_rank, cp)
    rec_layers = model.recurrent.num_layers
    passes = 2

    def busiest(layers: int, rec: int) -> int:
        return passes * int(max((layers * kv_sent + rec * recurrent.sent_bytes).max(),
                                (layers * kv_received + rec * recurrent.received_bytes).max()))

    return StepBytes(
        hybrid_busiest=busiest(model.num_attention_layers, rec_layers),
        hybrid_total=passes * (model.num_attention_layers * int(kv_sent.sum()) + rec_layers * recurrent.total_bytes),
        attention_busiest=busiest(model.num_mixing_layers, 0),
        attention_total=passes * model.num_mixing_layers * int(kv_sent.sum()),
        recurrent_total=passes * rec_layers * recurrent.total_bytes,
    )
