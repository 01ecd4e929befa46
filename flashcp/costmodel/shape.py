"""The model shape every price of flashcp is computed for (planner objective and bench projection alike)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flashcp.costmodel.comm import kv_bytes_per_token
from flashcp.costmodel.recurrent import RecurrentShape
from flashcp.costmodel.workload import FULL, KIND_CODES

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
    layer_kinds: tuple[tuple[str, int, int], ...] = ()
    """The layers by attention kind, ``(kind, size, count)`` runs: ``("window", W, n)``, ``("chunk", K, n)``,
    ``("full", 0, n)``, counts summing to ``layers``; () (also what runs of full layers alone become): every
    layer full causal attention."""
    recurrent: RecurrentShape | None = None
    """The model's recurrent layers (a hybrid), priced beside the ``layers`` attention layers
    (``objective.step_seconds_of``); None: none."""

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim, self.layers, self.dtype_bytes) < 1 or \
                self.num_heads % self.num_kv_heads or not self.hidden_mult > 0:
            raise ValueError(f"bad model shape: H={self.num_heads}, H_kv={self.num_kv_heads}, D={self.head_dim}, "
                             f"layers={self.layers}, {self.dtype_bytes} bytes per element")
        runs = tuple((str(kind), int(size), int(count)) for kind, size, count in self.layer_kinds)
        for kind, size, count in runs:
            if kind not in KIND_CODES or count < 1 or (size != 0 if kind == "full" else size < 1):
                raise ValueError(f"bad layer kind run ({kind!r}, {size}, {count}): needs a kind of "
                                 f"{', '.join(KIND_CODES)}, a size (0 for full, W or K tokens else) and a count >= 1")
        if runs and sum(count for _, _, count in runs) != self.layers:
            raise ValueError(f"the layer kind runs {runs} count {sum(c for _, _, c in runs)} layers, not the shape's "
                             f"{self.layers}")
        object.__setattr__(self, "layer_kinds", () if all(kind == "full" for kind, _, _ in runs) else runs)
        if isinstance(self.recurrent, dict):
            object.__setattr__(self, "recurrent", RecurrentShape(**self.recurrent))
        if self.recurrent is not None and self.recurrent.num_layers == 0:
            object.__setattr__(self, "recurrent", None)

    def kind_runs(self) -> tuple[tuple[int, int, int], ...]:
        """The layers the step is priced for, ``(kind code, size, count)`` (``workload.FULL`` ...), in order.

        Runs of one kind and size are merged; every layer full: ``((FULL, 0, layers),)``.
        """
        if not self.layer_kinds:
            return ((FULL, 0, self.layers),)
        merged: dict[tuple[int, int], int] = {}
        for kind, size, count in self.layer_kinds:
            key = (KIND_CODES[kind], size)
            merged[key] = merged.get(key, 0) + count
        return tuple((code, size, count) for (code, size), count in merged.items())

    def one_layer(self) -> tuple[AttentionShape, int]:
        """A shape whose step time, divided by the returned count, is that of the mean layer of this one.

        Every layer of one kind: that layer alone (count 1); several kinds or recurrent layers: this shape and
        its ``layers`` (the kinds keep their shares).
        """
        runs = self.kind_runs()
        if len(runs) > 1 or self.recurrent is not None:
            return self, self.layers
        kinds = () if not self.layer_kinds else ((self.layer_kinds[0][0], runs[0][1], 1),)
        return replace(self, layers=1, layer_kinds=kinds), 1

    @classmethod
    def from_params(cls, params: dict) -> AttentionShape:
        """The shape a plan's parameters (plan.json ``params``) price with: ``flashcp2``'s shape options.

        Fields the parameters do not name keep their defaults (a plan of another strategy: the default shape).
        """
        names = ("num_heads", "num_kv_heads", "head_dim", "layers")
        kinds = tuple(tuple(run) for run in params.get("layer_kinds") or ())
        recurrent = params.get("recurrent")
        return cls(**{name: int(params[name]) for name in names if params.get(name) is not None},
                   layer_kinds=kinds,  # type: ignore[arg-type]
                   recurrent=RecurrentShape(**recurrent) if recurrent else None)

    def token_flops(self) -> float:
        """FLOPs of one token's per-token layers, one layer, forward + backward (3x forward).

        Forward: Q and O projections ``2 * 2 * d^2``, K and V ``2 * 2 * d * d_kv``, MLP (two matrices)
        ``2 * 2 * d * hidden_mult * d``; ``d = H D``, ``d_kv = H_kv D``.
        """
        d = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        return 3.0 * (4.0 * d * d + 4.0 * d * d_kv + 4.0 * self.hidden_mult * d * d)

    def as_dict(self) -> dict:
        """Plain dict for plan.json (``layer_kinds`` as lists, ``recurrent`` a dict of its fields or None)."""
        out = {name: getattr(self, name) for name in self.__slots__}
        out["layer_kinds"] = [list(run) for run in self.layer_kinds]
        rec = self.recurrent
        out["recurrent"] = None if rec is None else {name: getattr(rec, name) for name in rec.__slots__}
        return out

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of K and V for one token (``kv_bytes_per_token``)."""
        return kv_bytes_per_token(self.num_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def q_row_bytes(self) -> int:
        """Bytes of one token's queries (or output)."""
        return self.num_heads * self.head_dim * self.dtype_bytes
