"""A small Llama-style decoder for packed, document-masked training with or without CP.

Shapes: T tokens of this rank (packed, documents back to back), H query heads, H_kv key/value heads, D head
dim, C model width, V vocabulary. Attention is injected as a callable ``attn_fn(q_THD, k_TKD, v_TKD) ->
out_THD`` so that the same module runs with ``cp_attention`` (CP) or a single-process document-masked reference.
Its training loss lives with the training code (``flashcp.train.loss.tiny_loss_sum``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AttnFn", "TinyConfig", "TinyDecoder", "apply_rope"]

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyConfig:
    """Model shape."""

    vocab_size: int = 512
    """Token ids must be below this."""
    dim: int = 64
    """Model width C."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads H."""
    num_kv_heads: int = 2
    """Key/value heads H_kv (GQA when below ``num_heads``)."""
    ffn_dim: int = 128
    """SwiGLU hidden width."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_heads", "num_kv_heads", "ffn_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_layers < 0:
            raise ValueError(f"num_layers must be at least 0, got {self.num_layers}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        if (self.dim // self.num_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.num_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """D."""
        return self.dim // self.num_heads


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x_THD: torch.Tensor, position_ids_T: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding by each token's position inside its document (rotate-half convention)."""
    half = x_THD.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=x_THD.dtype, device=x_THD.device) / half)
    angles_TF = position_ids_T.to(x_THD.dtype)[:, None] * inv_freq[None, :]
    cos, sin = angles_TF.cos()[:, None, :], angles_TF.sin()[:, None, :]
    x1, x2 = x_THD[..., :half], x_THD[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    """GQA attention whose core is the injected ``attn_fn``."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x_TC, position_ids_T, attn_fn: AttnFn):
        cfg, T = self.cfg, x_TC.shape[0]
        q_THD = apply_rope(self.wq(x_TC).view(T, cfg.num_heads, cfg.head_dim), position_ids_T, cfg.rope_theta)
        k_TKD = apply_rope(self.wk(x_TC).view(T, cfg.num_kv_heads, cfg.head_dim), position_ids_T, cfg.rope_theta)
        v_TKD = self.wv(x_TC).view(T, cfg.num_kv_heads, cfg.head_dim)
        return self.wo(attn_fn(q_THD, k_TKD, v_TKD).reshape(T, -1))


class Block(nn.Module):
    """Pre-norm attention + SwiGLU MLP."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x_TC, position_ids_T, attn_fn: AttnFn):
        x_TC = x_TC + self.attn(self.attn_norm(x_TC), position_ids_T, attn_fn)
        h_TC = self.mlp_norm(x_TC)
        return x_TC + self.w_down(F.silu(self.w_gate(h_TC)) * self.w_up(h_TC))


class TinyDecoder(nn.Module):
    """Embedding, ``num_layers`` blocks, final norm, untied output head."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids_T: torch.Tensor, position_ids_T: torch.Tensor, attn_fn: AttnFn) -> torch.Tensor:
        """Logits (T, V) for this rank's tokens."""
        x_TC = self.embed(input_ids_T)
        for block in self.blocks:
            x_TC = block(x_TC, position_ids_T, attn_fn)
        return self.head(self.norm(x_TC))

