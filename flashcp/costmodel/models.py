"""The models flashcp plans for: their shapes and the attention kind of every layer.

A ``ModelSpec`` is what a plan is priced for: heads, K/V heads, head dim, model width, the MLP width a token
passes through, vocabulary, and one ``LayerKind`` per layer (full causal attention, a sliding window of W
tokens, or chunks of K tokens; learned sinks and logit soft-capping beside them). It comes from:

- ``BUILTIN_MODELS``: a small table of today's open models, their numbers copied from each published
  ``config.json`` (``DEFAULT_MODEL``, Llama-3-8B, is what a plan is made for unless told otherwise);
- ``model_from_config``: a Hugging Face ``config.json`` (or its dict), read with the rules transformers
  itself applies to decide each layer's kind (``layer_types``, else ``sliding_window`` with the family's
  pattern, else ``attention_chunk_size`` with ``no_rope_layers``);
- ``resolve_model``: either, from the text a user typed (``flashcp plan --model NAME|CONFIG``).

A hybrid's recurrent layers (Gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba-2: Nemotron-H) are read into
``ModelSpec.recurrent`` (a ``RecurrentShape``) beside its attention ``layers``. A config with a layer flashcp
cannot price (latent attention, an unknown layer entry) is refused with a ``ModelError`` naming the layer and
its kind: a price made as if such a layer were full attention would be wrong in both its work and its
exchange.

``ModelSpec.attention_shape()`` is the bridge to the pricing (``AttentionShape``: heads, head dim, layers by
kind, and the per-token layers' FLOPs through ``hidden_mult``). This module reads JSON only: no transformers
import, so the cost model stays the bottom floor (tests check the reading against transformers' own
config classes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from flashcp.costmodel.recurrent import RecurrentShape
from flashcp.costmodel.shape import AttentionShape
from flashcp.errors import FlashcpError

__all__ = ["BUILTIN_MODELS", "CLASS_DEFAULTS", "DEFAULT_MODEL", "KINDS", "LayerKind", "ModelError", "ModelSpec",
           "as_model_spec", "model_from_config", "resolve_model"]

KINDS = ("full", "window", "chunk")
"""Attention kinds flashcp prices: full causal, sliding window of W tokens, chunks of K tokens."""


class ModelError(FlashcpError, ValueError):
    """A model flashcp cannot plan for, or a bad model description; the message names the field or layer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerKind:
    """What one layer's attention computes inside each document (``flashcp.runtime.layer_kinds`` runs it)."""

    kind: str = "full"
    """``full``: a token sees its document up to itself; ``window``: itself and the ``size - 1`` tokens before
    it (transformers' ``sliding_window``); ``chunk``: the tokens of its chunk ``[size * floor(p / size), p]``."""
    size: int | None = None
    """W or K in tokens for ``window`` and ``chunk``; None for ``full``."""
    sinks: bool = False
    """Whether the layer has learned per-head sink logits in its softmax (gpt-oss): no change to the work or
    the exchange, recorded for the runtime."""
    softcap: float | None = None
    """Logit soft-cap c (scores ``c * tanh(s / c)``, Gemma 2), or None."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ModelError(f"a layer kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "full" and self.size is not None:
            raise ModelError(f"a full attention layer has no size, got size={self.size!r}")
        if self.kind != "full" and (isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1):
            raise ModelError(f"a {self.kind} layer needs its size as a positive number of tokens, got {self.size!r}")
        if not isinstance(self.sinks, bool):
            raise ModelError(f"sinks must be true or false, got {self.sinks!r}")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, int | float) or not self.softcap > 0:
                raise ModelError(f"softcap must be a positive number or None, got {self.softcap!r}")
            object.__setattr__(self, "softcap", float(self.softcap))

    def __str__(self) -> str:
        text = self.kind if self.size is None else f"{self.kind} {self.size}"
        if self.sinks:
            text += " + sinks"
        if self.softcap is not None:
            text += f" softcap {self.softcap:g}"
        return text


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder model as flashcp prices it: its attention shape, MLP width and the kind of every layer."""

    name: str
    """What the model is called in plan.json, ``show`` and ``ls`` (a built-in's lower-case name)."""
    num_heads: int
    """H: query heads per layer."""
    num_kv_heads: int
    """K/V heads per layer (H for multi-head attention, fewer for grouped-query); divides H."""
    head_dim: int
    """D: elements per head."""
    hidden_size: int
    """Model width (residual stream) in elements; differs from ``H * D`` in some models (Gemma 3, gpt-oss)."""
    mlp_width: int
    """Active MLP width per token in elements: ``intermediate_size`` for a dense MLP; for a mixture of experts
    experts per token x expert width plus the shared experts' width (the mean over layers where dense and
    expert layers mix, rounded)."""
    vocab_size: int
    """Tokens in the vocabulary."""
    layers: tuple[LayerKind, ...]
    """One ``LayerKind`` per decoder layer, first layer first."""
    gated_mlp: bool = True
    """Whether the MLP has three matrices (gate, up, down: SwiGLU, GeGLU) rather than two."""
    recurrent: RecurrentShape | None = None
    """A hybrid's recurrent layers (their count in ``num_layers``), beside the attention ``layers``; None: none."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ModelError(f"a model needs a name, got {self.name!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "mlp_width", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(f"model {self.name}: {name} must be a positive whole number, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"model {self.name}: num_kv_heads must divide num_heads, got {self.num_kv_heads} K/V "
                             f"heads for {self.num_heads} heads")
        if not isinstance(self.gated_mlp, bool):
            raise ModelError(f"model {self.name}: gated_mlp must be true or false, got {self.gated_mlp!r}")
        if self.recurrent is not None and not isinstance(self.recurrent, RecurrentShape):
            raise ModelError(f"model {self.name}: recurrent must be a RecurrentShape or None, got "
                             f"{type(self.recurrent).__name__}")
        layers = tuple(self.layers) if isinstance(self.layers, list | tuple) else None
        if not layers or not all(isinstance(layer, LayerKind) for layer in layers):
            raise ModelError(f"model {self.name}: layers must be a non-empty tuple of LayerKind, got "
                             f"{self.layers!r:.80}")
        object.__setattr__(self, "layers", layers)

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    def token_flops(self) -> float:
        """FLOPs of one token through one layer's projections and MLP, forward + backward (3x forward).

        Forward, with ``h`` the model width, ``d = H D``, ``d_kv = H_kv D``, ``F`` the MLP width: Q and O
        ``2 * 2 * h * d``, K and V ``2 * 2 * h * d_kv``, MLP ``2 * m * h * F`` with ``m`` its matrices (3 gated,
        2 plain). Leaves out the router of a mixture of experts (``h`` x experts, under 1% for the built-ins),
        the norms, and the embedding and output layer (once per token, not per layer).
        """
        d = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        matrices = 3 if self.gated_mlp else 2
        forward = 4.0 * self.hidden_size * d + 4.0 * self.hidden_size * d_kv \
            + 2.0 * matrices * self.hidden_size * self.mlp_width
        return 3.0 * forward

    def attention_shape(self, dtype_bytes: int = 2) -> AttentionShape:
        """The ``AttentionShape`` this model is priced with: heads, K/V heads, head dim, layers and their kinds.

        ``layer_kinds`` counts the layers of each kind and size (window W, chunk K, full), in order of first
        appearance; a model of full layers alone gets the all-full default.

        ``AttentionShape`` prices a layer's per-token FLOPs as if the model width were ``H D`` and the MLP had
        two matrices of width ``hidden_mult * H D``. ``hidden_mult`` is set so that
        ``AttentionShape.token_flops()`` equals ``self.token_flops()`` exactly: for a dense gated model with
        ``hidden_size == H D`` (Llama, Qwen3, Mistral) it is ``1.5 * mlp_width / (H D)`` (3 matrices priced as
        2), for a plain MLP ``mlp_width / (H D)``. Where ``hidden_size != H D`` (Gemma-3-12B: 3840 vs 4096,
        gpt-oss-20B: 2880 vs 4096) the projections' difference is folded into it too, so it is no longer the
        MLP's width ratio, only the FLOPs are right.
        """
        d = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        mlp_flops = self.token_flops() / 3.0 - 4.0 * d * d - 4.0 * d * d_kv
        if not mlp_flops > 0:  # only a model whose width is far below H D with a tiny MLP
            raise ModelError(f"model {self.name}: its per-token FLOPs ({self.token_flops():.3g}) are below what "
                             f"AttentionShape prices for its attention projections alone (H D = {d}, hidden "
                             f"{self.hidden_size}), so no hidden_mult matches them")
        kinds: dict[tuple[str, int], int] = {}
        for layer, count in self.kind_counts().items():  # sinks and soft-capping change neither work nor exchange
            key = (layer.kind, layer.size or 0)
            kinds[key] = kinds.get(key, 0) + count
        return AttentionShape(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                              layers=self.num_layers, dtype_bytes=dtype_bytes, hidden_mult=mlp_flops / (4.0 * d * d),
                              layer_kinds=tuple((kind, size, count) for (kind, size), count in kinds.items()),
                              recurrent=self.recurrent)

    def kind_counts(self) -> dict[LayerKind, int]:
        """Each distinct layer kind and how many layers have it, in order of first appearance."""
        counts: dict[LayerKind, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        return counts

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for plan.json; layers as runs ``{"kind", "size", "sinks", "softcap", "count"}``.

        ``recurrent``: the fields of its ``RecurrentShape`` (or None).
        """
        runs: list[dict[str, Any]] = []
        for layer in self.layers:
            if runs and runs[-1]["layer"] == layer:
                runs[-1]["count"] += 1
            else:
                runs.append({"layer": layer, "count": 1})
        out: dict[str, Any] = {name: getattr(self, name) for name in _SCALAR_FIELDS}
        out["layers"] = [{"kind": run["layer"].kind, "size": run["layer"].size, "sinks": run["layer"].sinks,
                          "softcap": run["layer"].softcap, "count": run["count"]} for run in runs]
        rec = self.recurrent
        out["recurrent"] = None if rec is None else {name: getattr(rec, name) for name in rec.__slots__}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """The model ``as_dict`` wrote (plan.json's ``model``); ModelError naming a missing or unknown field."""
        if not isinstance(data, dict):
            raise ModelError(f"a model description must be a JSON object, got {type(data).__name__}")
        expected = set(_SCALAR_FIELDS) | {"layers", "recurrent"}
        if set(data) | {"recurrent"} != expected:  # plan.json written before hybrids were priced has no recurrent
            missing, unknown = sorted(expected - set(data)), sorted(set(data) - expected)
            raise ModelError(f"a model description needs the fields {', '.join(sorted(expected))}; missing: "
                             f"{', '.join(missing) or 'none'}, unknown: {', '.join(unknown) or 'none'}")
        runs = data["layers"]
        if not isinstance(runs, list):
            raise ModelError(f"model {data['name']}: layers must be a list of runs, got {type(runs).__name__}")
        layers: list[LayerKind] = []
        run_fields = {"kind", "size", "sinks", "softcap", "count"}
        for index, run in enumerate(runs):
            if not isinstance(run, dict) or set(run) != run_fields:
                raise ModelError(f"model {data['name']}: layer run {index} must have exactly the fields "
                                 f"{', '.join(sorted(run_fields))}, got {run!r:.80}")
            count = run["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ModelError(f"model {data['name']}: layer run {index} needs a positive count, got {count!r}")
            layers += [LayerKind(kind=run["kind"], size=run["size"], sinks=run["sinks"], softcap=run["softcap"])
                       ] * count
        recurrent = data.get("recurrent")
        try:
            rec = None if recurrent is None else RecurrentShape(**recurrent)
        except (TypeError, ValueError) as error:
            raise ModelError(f"model {data['name']}: bad recurrent layers {recurrent!r:.80}: {error}") from None
        return cls(**{name: data[name] for name in _SCALAR_FIELDS}, layers=tuple(layers), recurrent=rec)

    def describe(self) -> str:
        """One line for ``show`` and ``ls``: name, layers by kind, heads, widths."""
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.kind_counts().items())
        mixing = self.num_layers
        if self.recurrent is not None:
            kinds += f", {self.recurrent.num_layers} recurrent {self.recurrent.kind}"
            mixing += self.recurrent.num_layers
        return (f"{self.name}: {mixing} layers ({kinds}), {self.num_heads} heads / {self.num_kv_heads} "
                f"K/V x {self.head_dim}, hidden {self.hidden_size}, MLP {self.mlp_width}, vocab {self.vocab_size}")


_SCALAR_FIELDS = tuple(f.name for f in fields(ModelSpec) if f.name not in ("layers", "recurrent"))


# ---- the built-in table --------------------------------------------------------------------------------------


def _full(count: int, **extra: Any) -> list[LayerKind]:
    return [LayerKind(**extra)] * count


def _every(period: int, local: LayerKind, count: int, **extra: Any) -> list[LayerKind]:
    # ``period - 1`` local layers then one full one, as transformers' ``(i + 1) % period`` patterns
    return [local if (i + 1) % period else LayerKind(**extra) for i in range(count)]


def _builtin(name: str, heads: int, kv_heads: int, head_dim: int, hidden: int, mlp: int, vocab: int,
             layers: list[LayerKind], recurrent: RecurrentShape | None = None) -> ModelSpec:
    return ModelSpec(name=name, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                     mlp_width=mlp, vocab_size=vocab, layers=tuple(layers), recurrent=recurrent)


BUILTIN_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    # name, heads, K/V heads, head_dim, hidden, active MLP width, vocab, layers
    # meta-llama/Meta-Llama-3-8B config.json (head_dim = 4096 / 32)
    _builtin("llama-3-8b", 32, 8, 128, 4096, 14336, 128256, _full(32)),
    # meta-llama/Meta-Llama-3-70B config.json (head_dim = 8192 / 64)
    _builtin("llama-3-70b", 64, 8, 128, 8192, 28672, 128256, _full(80)),
    # Qwen/Qwen3-8B config.json (use_sliding_window false: every layer full)
    _builtin("qwen3-8b", 32, 8, 128, 4096, 12288, 151936, _full(36)),
    # mistralai/Mistral-7B-v0.1 config.json: sliding_window 4096 on every layer (v0.2 and later have none)
    _builtin("mistral-7b-v0.1", 32, 8, 128, 4096, 14336, 32000, _full(32, kind="window", size=4096)),
    # google/gemma-3-12b-pt config.json text_config (head_dim 256 and vocab 262208: Gemma3TextConfig's
    # defaults where that file leaves them out): sliding_window 1024, sliding_window_pattern 6
    _builtin("gemma-3-12b", 16, 8, 256, 3840, 15360, 262208,
             _every(6, LayerKind(kind="window", size=1024), 48)),
    # openai/gpt-oss-20b config.json: layer_types sliding (window 128) and full alternating, sinks on every
    # layer; 4 of 32 experts of width intermediate_size 2880 per token, no shared expert
    _builtin("gpt-oss-20b", 64, 8, 64, 2880, 4 * 2880, 201088,
             _every(2, LayerKind(kind="window", size=128, sinks=True), 24, sinks=True)),
    # meta-llama/Llama-4-Scout-17B-16E config.json text_config: attention_chunk_size 8192 on the RoPE layers,
    # every fourth layer NoPE and global (no_rope_layer_interval 4); every layer a mixture of experts, 1 of 16
    # routed experts of width intermediate_size 8192 plus the shared expert of the same width
    _builtin("llama-4-scout", 40, 8, 128, 5120, 8192 + 8192, 202048,
             _every(4, LayerKind(kind="chunk", size=8192), 48)),
    # Qwen/Qwen3-Next-80B-A3B config.json (transformers' Qwen3NextConfig() defaults): 48 layers, full attention
    # every fourth (12, gated), Gated DeltaNet otherwise (36: 32 value heads and 16 key heads of 128, conv 4);
    # 10 of 512 routed experts of width 512 plus the shared expert of width 512 per token
    _builtin("qwen3-next-80b-a3b", 16, 2, 256, 2048, 10 * 512 + 512, 151936, _full(12),
             RecurrentShape(kind="gdn", num_heads=32, key_dim=128, value_dim=128, num_groups=16, conv_width=4,
                            num_layers=36)),
)}
"""Built-in models by lower-case name (``resolve_model`` matches names case-insensitively)."""

DEFAULT_MODEL = "llama-3-8b"
"""The model a plan is made for when none is named: grouped-query, as the models trained at long context are."""


# ---- reading a Hugging Face config.json ------------------------------------------------------------------------

CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 256, "vocab_size": 256000},
    "gemma2": {"head_dim": 256, "vocab_size": 256000, "sliding_window": 4096, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"head_dim": 256, "vocab_size": 262208, "sliding_window": 4096, "sliding_window_pattern": 6},
    "gpt_oss": {"sliding_window": 128},
    "llama4_text": {"attention_chunk_size": 8192},
    "mistral": {"sliding_window": 4096},
    "nemotron_h": {"mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
                   "conv_kernel": 4},
    "qwen2": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "max_window_layers": 28},
    "qwen2_moe": {"use_sliding_window": False},
    "qwen3_moe": {"use_sliding_window": False},
    "qwen3_next": {"linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4},
    "smollm3": {"use_sliding_window": False},
}
"""What transformers' config class assumes for a field a ``config.json`` leaves out, where that differs from
the generic rule (head_dim = hidden / heads, no window, no chunk, no soft-cap): published files rely on these
(Gemma 3's leaves out its head_dim and vocabulary). Checked against the classes by the tests."""

_WINDOW_PATTERNS: dict[str, int] = {"gemma2": 2, "gpt_oss": 2, "cohere2": 4, "olmo3": 4, "exaone4": 4}
"""Families whose ``sliding_window`` applies to ``period - 1`` of every ``period`` layers when a config has no
``layer_types`` (transformers' own fallback); ``sliding_window_pattern`` overrides it, Gemma 3's default is
in ``CLASS_DEFAULTS``. Any other family with a window has it on every layer (Mistral, Mixtral, Phi-3)."""

_QWEN_WINDOW_RULES = {"qwen2": True, "qwen3": True, "qwen3_moe": False}
"""Families where ``use_sliding_window`` windows the layers from ``max_window_layers`` on (True) or every layer
(False), as transformers decides when a config has no ``layer_types``."""

_FIELD_ALIASES: dict[str, tuple[str, ...]] = {"hidden_size": ("n_embd",), "num_attention_heads": ("n_head",),
                                              "num_hidden_layers": ("n_layer",), "intermediate_size": ("n_inner",)}
"""GPT-2-style names (GPT-BigCode) of the fields transformers reaches through its ``attribute_map``."""

_SINK_MODEL_TYPES = frozenset({"gpt_oss"})
"""Families with learned attention sinks on every layer (no config field says so)."""

_PLAIN_MLP_MODEL_TYPES = frozenset({"bloom", "codegen", "falcon", "gpt2", "gpt_bigcode", "gpt_neox", "gptj",
                                    "nemotron", "opt", "persimmon", "phi", "starcoder2"})
"""Families whose MLP has two matrices (up, down); every other is priced as gated (three)."""

_ATTENTION_ENTRIES = {"full_attention": "full", "attention": "full", "sliding_attention": "window",
                      "chunked_attention": "chunk"}
_TOKEN_LOCAL_ENTRIES = frozenset({"mlp", "moe"})  # Nemotron-H blocks without token mixing
_HYBRID_SYMBOLS = {"*": "attention", "-": "mlp", "E": "moe", "M": "mamba"}  # Nemotron-H's hybrid_override_pattern


_READ_FIELDS = frozenset({
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size",
    "sliding_window", "attention_chunk_size", "attn_logit_softcapping", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "intermediate_size_mlp"})
"""Config fields a layer of a heterogeneous config (``per_layer_config``) may not override (one ModelSpec
shape for every layer)."""


def model_from_config(source: str | Path | dict[str, Any], *, name: str | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a Hugging Face ``config.json``: a path to it, to a folder holding it, or its dict.

    A multimodal config's ``text_config`` (Gemma 3, Llama 4) is the model read. Fields: heads, K/V heads
    (default: heads), head_dim (default: hidden / heads, or the family's class default), layers, vocabulary,
    the MLP width (experts per token x expert width plus shared experts for a mixture of experts), per layer
    its kind from ``layer_types``, else from ``sliding_window`` (every layer, Qwen's
    ``use_sliding_window``/``max_window_layers``, or the family's ``sliding_window_pattern``), else from
    ``attention_chunk_size`` on the layers ``no_rope_layers`` marks as using RoPE (Llama 4); sinks for
    gpt-oss, ``attn_logit_softcapping`` on every layer. ``name`` defaults to the folder holding the file,
    else the config's ``_name_or_path``, else its ``model_type``.

    A hybrid's recurrent layers (``linear_attention``, Nemotron-H's Mamba-2 entries) go into ``recurrent``
    (``_recurrent_shape``), its attention layers into ``layers``.

    Raises ModelError naming the file and the field or layer when a required field is missing or a layer is
    a kind flashcp cannot price (latent attention, recurrent layers set by a period or index list, an unknown
    ``layer_types`` entry).
    """
    data, where, default_name = _load_config(source)
    nested = data.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else data
    model_type = str(text.get("model_type") or data.get("model_type") or "")
    config = _Config(text, model_type, where)
    _refuse_unpriceable(config)
    heads = config.required("num_attention_heads", "the number of query heads")
    hidden = config.required("hidden_size", "the model width")
    vocab = config.required("vocab_size", "the vocabulary size")
    sinks = model_type in _SINK_MODEL_TYPES
    softcap = config.get("attn_logit_softcapping")
    read, recurrent_layers = _layer_kinds(config)
    layers = tuple(LayerKind(kind=kind, size=size, sinks=sinks, softcap=softcap) for kind, size in read)
    mlp_width = _mlp_width(config, len(layers))
    kv_heads = config.get("num_key_value_heads") or (1 if config.get("multi_query") else heads)  # GPT-BigCode: MQA
    try:
        return ModelSpec(name=name or default_name or str(data.get("_name_or_path") or "") or model_type or "model",
                         num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=config.get("head_dim") or hidden // heads, hidden_size=hidden, mlp_width=mlp_width,
                         vocab_size=vocab, layers=layers, gated_mlp=model_type not in _PLAIN_MLP_MODEL_TYPES,
                         recurrent=_recurrent_shape(config, recurrent_layers) if recurrent_layers else None)
    except ModelError as error:
        raise ModelError(f"{where}: {error}") from None


def resolve_model(text: str) -> ModelSpec:
    """A built-in model by name (any case), or the model of a ``config.json`` path or of a folder holding one.

    Raises ModelError listing the built-in names when ``text`` is neither.
    """
    spec = BUILTIN_MODELS.get(text.strip().lower())
    if spec is not None:
        return spec
    path = Path(text.strip()).expanduser()
    if text.strip() and (path.is_dir() or path.is_file()):  # an empty name is not the current folder
        return model_from_config(path)
    raise ModelError(f"unknown model {text!r}: name a built-in model ({', '.join(BUILTIN_MODELS)}) or a Hugging Face "
                     "config.json (or a folder holding one)")


def as_model_spec(model: ModelSpec | str | dict[str, Any] | Any) -> ModelSpec:
    """The ``ModelSpec`` of what a caller has at hand: a spec, a built-in name or config path, or a config.

    A Hugging Face config as its dict (``config.json``'s content) or as the config object itself (anything with
    ``to_dict()``, e.g. ``model.config``). Raises ModelError as ``resolve_model`` and ``model_from_config`` do.
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str | Path):
        return resolve_model(str(model))
    if isinstance(model, dict):
        return model_from_config(model)
    to_dict = getattr(model, "to_dict", None)
    if callable(to_dict):
        return model_from_config(to_dict())
    raise ModelError(f"a model must be a ModelSpec, a built-in name, a config path or a Hugging Face config, got "
                     f"{type(model).__name__}")


class _Config:
    """A config dict read the way its transformers class would: an absent field takes the class default."""

    def __init__(self, text: dict[str, Any], model_type: str, where: str):
        self.text, self.model_type, self.where = text, model_type, where

    def get(self, field: str, default: Any = None) -> Any:
        for name in (field, *_FIELD_ALIASES.get(field, ())):
            if name in self.text:
                value = self.text[name]
                if value is None and name == "n_inner":  # GPT-2 style: an MLP of 4 x the width
                    hidden = self.get("hidden_size")
                    return 4 * hidden if isinstance(hidden, int) else None
                return value
        return CLASS_DEFAULTS.get(self.model_type, {}).get(field, default)

    def required(self, field: str, meaning: str) -> int:
        value = self.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelError(f"{self.where} needs {field} ({meaning}) as a positive whole number, got {value!r}")
        return value

    def refuse(self, layer: int | str, kind: str, why: str) -> ModelError:
        where = f"layer {layer}" if isinstance(layer, int) else layer
        return ModelError(f"{self.where}: {where} is {kind}, which flashcp cannot price ({why}); it plans for "
                          "full, sliding-window and chunked causal attention only")


def _load_config(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str, str | None]:
    if isinstance(source, dict):
        model_type = source.get("model_type") or "?"
        return source, f"the {model_type} config", None
    path = Path(source).expanduser()
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"no Hugging Face config at {path}: give a config.json or a folder holding one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"cannot read {path} as a Hugging Face config.json: {error}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} holds a JSON {type(data).__name__}, not a Hugging Face config (an object)")
    return data, str(path), path.parent.name if path.name == "config.json" else path.stem


def _refuse_unpriceable(config: _Config) -> None:
    # layer kinds outside what any layer_types says: latent attention, recurrent layers beside attention
    if config.get("kv_lora_rank") is not None:
        raise config.refuse(0, f"multi-head latent attention (kv_lora_rank={config.get('kv_lora_rank')})",
                            "its keys and values are projected from a shared latent, and the query/key and value "
                            "heads differ in size")
    for field, why in (("attn_layer_period", "attention on some layers, recurrent layers on the others"),
                       ("attn_layer_indices", "attention on the layers listed, recurrent layers on the others"),
                       ("hybrid_layer_ids", "layers mixing attention with recurrent heads")):
        if config.get(field) is not None:
            layer = _first_recurrent_layer(config)
            raise config.refuse(layer if layer is not None else f"a layer its {field} sets",
                                f"recurrent (its config sets {field}={config.get(field)!r})", why)
    for layer, overrides in sorted((config.get("per_layer_config") or {}).items(), key=lambda item: int(item[0])):
        read = sorted(set(overrides or ()) & _READ_FIELDS)
        if read:  # transformers' heterogeneous configs: one shape per layer
            raise ModelError(f"{config.where}: layer {layer} overrides {', '.join(read)} (per_layer_config), and "
                             "flashcp prices models whose layers share one shape, window and chunk size")
    if config.get("use_bidirectional_attention"):
        raise config.refuse(0, "bidirectional attention (use_bidirectional_attention)", "it is not causal")


def _first_recurrent_layer(config: _Config) -> int | None:
    count = config.get("num_hidden_layers")
    if not isinstance(count, int):
        return None
    indices = config.get("attn_layer_indices")
    period, offset = config.get("attn_layer_period"), config.get("attn_layer_offset", 0)
    for layer in range(count):
        if indices is not None and layer not in indices:
            return layer
        if indices is None and period and layer % period != offset:
            return layer
    return None


def _layer_kinds(config: _Config) -> tuple[list[tuple[str, int | None]], int]:
    """``(kind, size)`` per attention layer, in the order of the rules transformers applies.

    With the count of the recurrent layers the config declares beside them.
    """
    entries, field = _declared_layers(config)
    if entries is not None:
        kinds: list[tuple[str, int | None]] = []
        recurrent = 0
        for index, entry in enumerate(entries):
            if entry in _TOKEN_LOCAL_ENTRIES and field != "layer_types":
                continue
            kind = _ATTENTION_ENTRIES.get(entry)
            if kind is None and entry in _RECURRENT_ENTRIES:
                recurrent += 1
                continue
            if kind is None:
                raise config.refuse(index, f"{entry!r} ({field})", "not attention of a kind it knows")
            kinds.append((kind, None if kind == "full" else _layer_size(config, kind, index)))
        if not kinds:
            raise ModelError(f"{config.where}: its {field} holds no attention layer")
        return kinds, recurrent
    count = config.required("num_hidden_layers", "the number of layers")
    window, chunk = config.get("sliding_window"), config.get("attention_chunk_size")
    if chunk is not None:  # Llama 4: chunked where RoPE is used, global on the NoPE layers
        interval = config.get("no_rope_layer_interval", 4)
        uses_rope = list(config.get("no_rope_layers") or ()) or [int((i + 1) % interval != 0) for i in range(count)]
        return [("chunk", _layer_size(config, "chunk", i)) if uses_rope[i] else ("full", None)
                for i in range(count)], 0
    if window is None:
        return [("full", None)] * count, 0
    if config.get("use_sliding_window") is not None:  # Qwen: a window only when use_sliding_window is set
        if not config.get("use_sliding_window"):
            return [("full", None)] * count, 0
        if config.model_type not in _QWEN_WINDOW_RULES:
            raise ModelError(f"{config.where} sets use_sliding_window without layer_types, and which layers of a "
                             f"{config.model_type or 'model'} that windows is known to flashcp for "
                             f"{', '.join(_QWEN_WINDOW_RULES)} only; give the config its layer_types (transformers "
                             "writes them when it saves a config)")
        first = config.get("max_window_layers") if _QWEN_WINDOW_RULES[config.model_type] else 0
        return [("window", _layer_size(config, "window", i)) if i >= first else ("full", None)
                for i in range(count)], 0
    pattern = config.get("sliding_window_pattern") or _WINDOW_PATTERNS.get(config.model_type)
    if isinstance(pattern, str):  # Exaone 4: "LLLG", L local, G global
        local = [pattern[i % len(pattern)] == "L" for i in range(count)]
    else:
        local = [not pattern or bool((i + 1) % pattern) for i in range(count)]
    return [("window", _layer_size(config, "window", i)) if local[i] else ("full", None) for i in range(count)], 0


def _declared_layers(config: _Config) -> tuple[list[str] | None, str]:
    for field in ("layer_types", "layers_block_type"):
        entries = config.get(field)
        if entries:
            count = config.get("num_hidden_layers")
            if field == "layer_types" and isinstance(count, int) and len(entries) != count:
                raise ModelError(f"{config.where}: layer_types lists {len(entries)} layers, num_hidden_layers is "
                                 f"{count}")
            return [str(entry) for entry in entries], field
    pattern = config.get("hybrid_override_pattern")
    if pattern:
        return [_HYBRID_SYMBOLS.get(symbol, repr(symbol)) for symbol in pattern], "hybrid_override_pattern"
    return None, ""


def _layer_size(config: _Config, kind: str, layer: int) -> int:
    field = "sliding_window" if kind == "window" else "attention_chunk_size"
    size = config.get(field)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ModelError(f"{config.where}: layer {layer} is {kind}ed attention and needs {field} as a positive number "
                         f"of tokens, got {size!r}")
    return size


_RECURRENT_ENTRIES = frozenset({"linear_attention", "mamba", "M"})
"""Layer entries of the recurrent mixers flashcp's runtime runs and prices (Gated DeltaNet, Mamba-2)."""


def _recurrent_shape(config: _Config, count: int) -> RecurrentShape:
    """The ``RecurrentShape`` of a hybrid's ``count`` recurrent layers, from the fields transformers reads.

    Mamba-2 for Nemotron-H (or a config with ``mamba_num_heads``), else Gated DeltaNet (Qwen3-Next, Qwen3.5).
    """
    if config.get("mamba_num_heads") is not None or config.model_type == "nemotron_h":
        return RecurrentShape(kind="ssd", num_heads=config.required("mamba_num_heads", "the Mamba-2 heads"),
                              key_dim=config.required("ssm_state_size", "the Mamba-2 state size"),
                              value_dim=config.required("mamba_head_dim", "the Mamba-2 head dim"),
                              num_groups=config.required("n_groups", "the Mamba-2 B/C groups"),
                              conv_width=config.required("conv_kernel", "the Mamba-2 convolution taps"),
                              num_layers=count)
    return RecurrentShape(kind="gdn",
                          num_heads=config.required("linear_num_value_heads", "the Gated DeltaNet value heads"),
                          key_dim=config.required("linear_key_head_dim", "the Gated DeltaNet key head dim"),
                          value_dim=config.required("linear_value_head_dim", "the Gated DeltaNet value head dim"),
                          num_groups=config.required("linear_num_key_heads", "the Gated DeltaNet key heads"),
                          conv_width=config.required("linear_conv_kernel_dim", "the Gated DeltaNet convolution taps"),
                          num_layers=count)


_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_topk", "moe_k")
_ROUTED_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
"""The names families give the experts a token is routed to, the routed experts and the shared experts."""


def _mlp_width(config: _Config, count: int) -> int:
    """The active MLP width per token, averaged over the layers where dense and expert layers mix.

    An expert layer: experts per token x expert width (``moe_intermediate_size``, else ``intermediate_size``)
    plus the shared experts (``shared_expert_intermediate_size``, or their count x the expert width; Llama 4:
    one of the routed width); a dense layer: ``intermediate_size`` (Llama 4: ``intermediate_size_mlp``).
    """
    per_token, experts = _first(config, _EXPERTS_PER_TOKEN), _first(config, _ROUTED_EXPERTS)
    if not per_token or not experts:
        return config.required("intermediate_size", "the MLP width")
    if not isinstance(per_token, int) or not isinstance(experts, int):  # Hunyuan allows one count per layer
        raise ModelError(f"{config.where}: experts per token {per_token!r} and routed experts {experts!r} must be "
                         "one whole number each; flashcp prices models whose layers share one MLP width")
    expert = config.required("moe_intermediate_size" if config.get("moe_intermediate_size") is not None else
                             "intermediate_size", "the expert width")
    shared_count = _first(config, _SHARED_EXPERTS) or 0
    if isinstance(shared_count, bool) or not isinstance(shared_count, int):
        raise ModelError(f"{config.where}: the shared experts' count must be a whole number, got {shared_count!r}")
    shared = config.required("shared_expert_intermediate_size", "the shared experts' width") \
        if config.get("shared_expert_intermediate_size") else shared_count * expert
    dense_field = "intermediate_size"
    if config.model_type == "llama4_text":
        shared, dense_field = expert, "intermediate_size_mlp"
    expert_layers = [_is_expert_layer(config, layer, count) for layer in range(count)]
    dense = 0 if all(expert_layers) else config.required(dense_field, "the dense layers' MLP width")
    moe = per_token * expert + shared
    return round(sum(moe if is_expert else dense for is_expert in expert_layers) / count)


def _first(config: _Config, names: tuple[str, ...]) -> Any:
    return next((config.get(name) for name in names if config.get(name) is not None), None)


def _is_expert_layer(config: _Config, layer: int, count: int) -> bool:
    kinds = config.get("mlp_layer_types")  # transformers' per-layer list where a family has one
    if kinds:
        return kinds[layer] == "sparse"
    if config.model_type == "llama4_text":
        step = config.get("interleave_moe_layer_step", 1)
        moe_layers = config.get("moe_layers")
        return layer in (moe_layers if moe_layers is not None else range(step - 1, count, step))
    if config.get("moe_layer_start_index") is not None:  # Ernie 4.5
        end = config.get("moe_layer_end_index")
        return (layer + 1) % (config.get("moe_layer_interval") or 1) == 0 and \
            config.get("moe_layer_start_index") <= layer <= (count - 1 if end is None or end < 0 else end)
    if config.get("first_k_dense_replace") is not None:  # DeepSeek, GLM-4 MoE: the first k layers dense
        return layer >= config.get("first_k_dense_replace") and layer % (config.get("moe_layer_freq") or 1) == 0
    if layer in (config.get("mlp_only_layers") or ()):  # Qwen MoE
        return False
    return (layer + 1) % (config.get("decoder_sparse_step") or 1) == 0
