"""The model shape every price of flashcp is computed for (planner objective and bench projection alike)."""

from __future__ import annotations

from dataclasses import dataclass

from flashcp.costmodel.comm import kv_bytes_per_token

__all__ = ["AttentionShape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionShape:
    """The model shape a step is priced for: attention heads, head size, layers, element size, MLP width.

    One shape for the planner's step-time objective and the bench's projection.
    """

    num_heads: int = 32
    """H: query heads."""
    num_kv_heads: int = 32
    """K/V heads."""
    head_dim: int = 128
    """D."""
    layers: int = 1
    """Transformer layers (the step time scales with it)."""
    dtype_bytes: int = 2
    """Bytes per element (bf16)."""
    hidden_mult: float = 4.0
    """MLP width over the model width ``H D`` (for the per-token layers under token slack)."""

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.layers, self.dtype_bytes) < 1 or \
                self.num_heads % self.num_kv_heads or not self.hidden_mult > 0:
            raise ValueError(f"bad model shape: H={self.num_heads}, H_kv={self.num_kv_heads}, D={self.head_dim}, "
                             f"layers={self.layers}, {self.dtype_bytes} bytes per element")

    @classmethod
    def from_params(cls, params: dict) -> AttentionShape:
        """The shape a plan's parameters (plan.json ``params``) price with: ``flashcp2``'s shape options.

        Fields the parameters do not name keep their defaults (a plan of another strategy: the default shape).
        """
        names = ("num_heads", "num_kv_heads", "head_dim", "layers")
        return cls(**{name: int(params[name]) for name in names if params.get(name) is not None})

    def token_flops(self) -> float:
        """FLOPs of one token's per-token layers, one layer, forward + backward (3x forward).

        Forward: Q and O projections ``2 * 2 * d^2``, K and V ``2 * 2 * d * d_kv``, MLP (two matrices)
        ``2 * 2 * d * hidden_mult * d``; ``d = H D``, ``d_kv = H_kv D``.
        """
        d = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        return 3.0 * (4.0 * d * d + 4.0 * d * d_kv + 4.0 * self.hidden_mult * d * d)

    def as_dict(self) -> dict:
        """Plain dict for plan.json."""
        return {name: getattr(self, name) for name in self.__slots__}

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of K and V for one token (``kv_bytes_per_token``)."""
        return kv_bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def q_row_bytes(self) -> int:
        """Bytes of one token's queries (or output)."""
        return self.num_heads * self.head_dim * self.dtype_bytes
