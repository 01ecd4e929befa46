"""torchtitan: train torchtitan's decoders (Llama3, Qwen3) with flashcp context parallelism.

torchtitan (0.3) shards a sequence over its CP ranks with torch's HeadTail/PTRR balancers and all-gathers the
whole K/V of every layer (``distributed/context_parallel``); its varlen attention refuses CP. This module
keeps torchtitan's model and replaces what CP touches:

- **model transform**: ``apply_cp_attention(model)`` replaces the inner attention module of every layer
  (torchtitan's ``VarlenAttention``, ``FlexAttention`` or ``ScaledDotProductAttention``) with
  ``CPInnerAttention``, which runs ``cp_attention`` on this rank's packed tokens. torchtitan's
  ``GQAttention`` around it is untouched: its QKV projection, Qwen3's q/k norms, RoPE and output
  projection run as before, and RoPE reads the ``positions`` the model is called with: the batch's
  per-document ``position_ids``, so a document whose shard starts mid-document on this rank is rotated from
  its true positions.
- **data adapter**: ``titan_inputs(batch, attn)`` turns a ``CPLoader`` batch into the model's forward
  arguments, ``model(tokens_BT, positions=positions_BT, attention_masks=attn)``: a batch of one packed
  sequence, ``T`` this rank's tokens. The ``attention_masks`` slot, which torchtitan threads through every
  layer to its inner attention, carries the batch's ``CPAttention`` (its ``CPAttnMeta``, CP group, comm mode
  and kernels): the document mask comes from the plan, not from a BlockMask or varlen offsets.
- **loss**: ``titan_loss_sum`` applies torchtitan's own ``CrossEntropyLoss`` (a sum over this rank's
  labels, in float32) to the logits; ``flashcp.train.train_step`` divides it by the label tokens of the whole
  global batch, as torchtitan's trainer divides by its ``global_valid_tokens``, and sums gradients over
  every rank, so a step equals one process's step on the global batch.
- **meshes and FSDP2**: ``TitanMeshes.from_parallelism`` reads torchtitan's ``ParallelismConfig``
  (``context_parallel_degree`` is the plan's ``cp``, ``data_parallel_shard_degree`` x
  ``data_parallel_replicate_degree`` the replicas) and lays ranks out as torchtitan's ``ParallelDims`` does;
  ``shard_titan_model`` applies torchtitan's own ``apply_fsdp_to_decoder`` over ``dp_shard x cp`` (HSDP
  when ``dp_replicate`` > 1), gradients summed.

One step, on every rank::

    meshes = TitanMeshes.from_parallelism(ParallelismConfig(context_parallel_degree=2), device_type="cuda")
    model = build_titan_model(titan_model_config("llama3", "8B", attn_backend="varlen"), device="cuda",
                              meshes=meshes, param_dtype=torch.bfloat16)  # FSDP2 on meta: only shards built
    loader = CPLoader.from_mesh(DATA, "cp2-flashcp2", meshes.mesh)
    for batch in loader:
        train_step(model, optimizer, batch.to("cuda"), titan_loss_sum, groups=meshes.groups, comm="a2a")

torchtitan's ``Trainer`` does not run on a CPU-only machine (README, "torchtitan"): flashcp's own loop
(``flashcp.train``, ``--model titan-llama3``) drives the model instead.

Shape legend: ``B`` batch (always 1: one packed sequence per rank), ``L`` = ``T`` this rank's tokens, ``N``
heads, ``H`` head dim (torchtitan's names for the tensors it hands over), ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashcp.runtime import CPAttention
from flashcp.runtime.loader import Batch
from flashcp.train.loss import LossSumFn
from flashcp.train.parallel import ParallelGroups

try:
    from torchtitan.components.loss import BaseLoss, CrossEntropyLoss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common import FlexAttention, ScaledDotProductAttention, VarlenAttention
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
    from torchtitan.protocols.module import Module
    from torchtitan.tools.utils import set_default_dtype
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(f"flashcp.integrations.torchtitan needs torchtitan ({e}); install it with "
                      "pip install 'flashcp[torchtitan]'") from None

__all__ = ["REPLACED_KINDS", "TITAN_ARCHITECTURES", "CPInnerAttention", "TitanMeshes", "apply_cp_attention",
           "build_titan_model", "make_titan_loss_sum", "shard_titan_model", "titan_inputs", "titan_loss_sum",
           "titan_model_config"]

TITAN_ARCHITECTURES = ("llama3", "qwen3")
"""torchtitan model families ``titan_model_config`` builds (dense decoders)."""

TITAN_MODEL_MODULES = ("torchtitan.models.llama3.", "torchtitan.models.qwen3.")
"""Modules of the torchtitan decoders ``apply_cp_attention`` accepts (their layers are GQAttention and MLP or
mixture-of-experts feed-forward only)."""

REPLACED_KINDS = (VarlenAttention, FlexAttention, ScaledDotProductAttention)
"""The torchtitan inner attention modules ``apply_cp_attention`` replaces."""


class CPInnerAttention(Module):
    """torchtitan inner attention that runs ``cp_attention`` on this rank's packed tokens.

    Called by torchtitan's ``GQAttention`` as ``inner(q_BLNH, k_BLNH, v_BLNH, attention_masks=..., scale=...,
    enable_gqa=...)`` with RoPE already applied; ``attention_masks`` must be the batch's ``CPAttention``
    (``titan_inputs`` puts it there). Causal attention inside each document, over the replaced layer's
    sliding window if it had one; no attention dropout, score modification or LSE epilogue (``out_transform``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """The replaced layer's window; the batch's CPAttention brings the meta, group, comm and kernels."""

        replaced: str = ""
        """Class name of the torchtitan module this one replaced (for the model's repr)."""
        window: int | None = None
        """Sliding window W in tokens, the query included (a ``VarlenAttention`` of ``window_size`` (W-1, 0));
        None: the whole document before the query."""

    def __init__(self, config: Config):
        super().__init__()
        self.replaced = config.replaced
        self.window = config.window

    def extra_repr(self) -> str:
        """What the module replaced and its window, for ``print(model)``."""
        words = [f"replaced={self.replaced}"] if self.replaced else []
        return ", ".join(words + ([] if self.window is None else [f"window={self.window}"]))

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: float | None = None, enable_gqa: bool = False,
                is_causal: bool = True, score_mod: Any = None, out_transform: Any = None,
                **kwargs: Any) -> torch.Tensor:
        """``out_BLNH`` (1, T, N, H): queries (1, T, N, H) over keys and values (1, T, N_kv, H).

        ``scale`` is the softmax scale (None: ``1 / sqrt(H)``); ``enable_gqa`` needs nothing here
        (``cp_attention`` takes ``N % N_kv == 0`` heads as they come). Raises ValueError for a call this
        module cannot serve.
        """
        if not isinstance(attention_masks, CPAttention):
            raise ValueError("a model with flashcp attention takes the batch's CPAttention as attention_masks, "
                             f"got {type(attention_masks).__name__}; call it with "
                             "model(tokens, **extra) where tokens, labels, extra = titan_inputs(batch, attn)")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"cp_attention takes one packed sequence per rank (batch size 1), got batch size "
                             f"{q_BLNH.shape[0]}")
        if not is_causal or score_mod is not None or out_transform is not None:
            raise ValueError("cp_attention computes causal document attention only; got "
                             f"is_causal={is_causal}, score_mod={score_mod}, out_transform={out_transform}")
        changing = {name: value for name, value in kwargs.items() if value is not None}
        if changing:  # never dropped: an argument flashcp does not know may change the result
            raise ValueError(f"cp_attention cannot honour the inner-attention arguments {sorted(changing)}; it "
                             "computes plain causal attention inside each document")
        out_THD = attention_masks(q_BLNH[0], k_BLNH[0], v_BLNH[0], softmax_scale=scale, window=self.window)
        return out_THD[None]


def apply_cp_attention(model: nn.Module) -> int:
    """Replace every inner attention module of ``model`` with ``CPInnerAttention``; returns how many.

    The model transform: torchtitan's ``VarlenAttention`` (causal, whole or windowed), ``FlexAttention``
    and ``ScaledDotProductAttention`` are replaced wherever a module holds one as ``inner_attention`` (every
    ``GQAttention`` of a Llama3 or Qwen3 decoder). Run it before FSDP2 wrapping; the replaced modules hold
    no parameters, so weights and checkpoints are unchanged. Idempotent. Raises ValueError (one sentence)
    for a model that is not a Llama3 or Qwen3 decoder (``TITAN_MODEL_MODULES``: gpt-oss's sinks, DeepSeek's
    latent attention, Qwen3.5's Gated DeltaNet layers are refused before any step; the sentence names a
    windowed layer when there is one), a convolution, an attention module other than ``GQAttention``, a model
    without inner attention, or one with an inner attention of another kind or a window that is not causal. A
    ``VarlenAttention`` of ``window_size`` (W-1, 0) (a sliding window of W tokens) runs ``cp_attention`` with
    ``window=W``, whose exchange moves only the W-1 keys before each piece; a FlexAttention layer of these
    decoders uses the causal document mask they build.
    """
    family = type(model).__module__
    if not family.startswith(TITAN_MODEL_MODULES):
        windowed = _windowed_layer(model)
        whose = "" if windowed is None else f", whose layer {windowed[0]} has a sliding window of {windowed[1]} tokens"
        raise ValueError(f"flashcp trains torchtitan's {', '.join(TITAN_ARCHITECTURES)} decoders exactly under CP, "
                         f"got a {type(model).__name__} ({family}){whose}; its layers are not verified to be plain "
                         "causal attention (windows run in llama3 and qwen3 varlen layers only)")
    replaced = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            raise ValueError(f"module {name} of the {type(model).__name__} is a {type(module).__name__}, a "
                             "convolution over tokens, which flashcp's CP does not run exactly")
        inner = module._modules.get("inner_attention")
        if inner is None:
            continue
        where = f"{name}.inner_attention" if name else "inner_attention"
        if type(module) is not GQAttention:
            raise ValueError(f"{name} is a {type(module).__name__}, not torchtitan's GQAttention; flashcp runs "
                             "plain grouped-query attention only (no sinks, latent or gated attention)")
        if isinstance(inner, CPInnerAttention):
            replaced += 1
            continue
        if not isinstance(inner, REPLACED_KINDS):
            raise ValueError(f"{where} is a {type(inner).__name__}; flashcp replaces "
                             f"{', '.join(k.__name__ for k in REPLACED_KINDS)}")
        window = None
        if isinstance(inner, VarlenAttention) and tuple(inner.window_size) != (-1, 0):
            left, right = inner.window_size
            if right != 0 or left < 0:
                raise ValueError(f"{where} has window_size {inner.window_size}; flashcp computes causal attention, "
                                 "over whole documents (window_size (-1, 0)) or a sliding window of W tokens "
                                 "(window_size (W-1, 0))")
            window = left + 1
        module.inner_attention = CPInnerAttention.Config(replaced=type(inner).__name__, window=window).build()
        replaced += 1
    if not replaced:
        raise ValueError(f"found no inner attention module in a {type(model).__name__}; apply_cp_attention "
                         "takes a torchtitan decoder (Llama3, Qwen3)")
    return replaced


def _windowed_layer(model: nn.Module) -> tuple[str, int] | None:
    """``(layer, W)`` of the first layer with a sliding window of W tokens, from the model's config; or None.

    torchtitan 0.3's windowed decoders (gpt-oss, muse_glimmer) declare it as ``sliding_window_size`` on a
    layer's attention config.
    """
    for index, layer in enumerate(getattr(getattr(model, "config", None), "layers", None) or ()):
        size = getattr(getattr(layer, "attention", None), "sliding_window_size", None)
        if isinstance(size, int):
            return f"layers.{index}.attention", size
    return None


def _registry(arch: str):
    if arch == "llama3":
        import torchtitan.models.llama3 as family
    elif arch == "qwen3":
        import torchtitan.models.qwen3 as family  # type: ignore[no-redef]
    else:
        raise ValueError(f"unknown torchtitan architecture '{arch}' (choose from {', '.join(TITAN_ARCHITECTURES)})")
    return family


def titan_model_config(arch: str = "llama3", flavor: str = "debugmodel", *, attn_backend: str = "flex",
                       vocab_size: int | None = None, dim: int | None = None, num_layers: int | None = None,
                       num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                       ffn_dim: int | None = None, max_seq_len: int | None = None) -> Decoder.Config:
    """A torchtitan model config from its registry (``arch``'s ``model_registry(flavor, attn_backend)``).

    Without shape arguments this is the registered flavor, e.g. ``llama3`` ``debugmodel``. Shape
    arguments rebuild it smaller or larger with torchtitan's own layer builder for the family (its private
    ``_build_llama3_layers`` / ``_build_qwen3_layers``, hence the extra's upper bound on torchtitan), so
    each block keeps the flavor's structure, RoPE kind, scaling and initialisation; unset ones keep the
    flavor's value (``head_dim`` becomes ``dim // num_heads`` when either changes, ``ffn_dim`` torchtitan's
    ``compute_ffn_hidden_dim(dim)`` when ``dim`` does). ``max_seq_len`` sizes the RoPE cache: positions are
    per document, so the context length is enough. Raises ValueError for an unknown architecture or flavor,
    a bad shape, or shape arguments for a mixture-of-experts flavor.
    """
    family = _registry(arch)
    try:
        config = family.model_registry(flavor, attn_backend=attn_backend).model
    except KeyError:
        configs = family.llama3_configs if arch == "llama3" else family.qwen3_configs
        raise ValueError(f"torchtitan {arch} has no flavor '{flavor}' (choose from {', '.join(configs)})") from None
    attention = config.layers[0].attention
    old_dim, old_heads = config.dim, attention.n_heads
    shape = dict(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, ffn_dim=ffn_dim)
    if all(v is None for v in shape.values()):
        if max_seq_len is not None:
            for layer in config.layers:
                layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=max_seq_len)
        return config
    if any(getattr(layer, "moe", None) is not None for layer in config.layers):
        raise ValueError(f"torchtitan {arch} '{flavor}' is a mixture-of-experts flavor; flashcp rebuilds dense "
                         "flavors at another shape only (use it without shape arguments)")
    dim = old_dim if dim is None else dim
    num_heads = old_heads if num_heads is None else num_heads
    if num_kv_heads is None:
        num_kv_heads = attention.n_kv_heads if attention.n_kv_heads is not None else num_heads
    if head_dim is None:
        head_dim = attention.head_dim if (dim, num_heads) == (old_dim, old_heads) and attention.head_dim \
            else dim // num_heads
    if ffn_dim is None:
        ffn_dim = config.layers[0].feed_forward.w1.out_features if dim == old_dim else compute_ffn_hidden_dim(dim)
    vocab_size = config.vocab_size if vocab_size is None else vocab_size
    num_layers = len(config.layers) if num_layers is None else num_layers
    if min(dim, num_heads, num_kv_heads, head_dim, ffn_dim, vocab_size, num_layers) < 1 or num_heads % num_kv_heads:
        raise ValueError(f"bad {arch} shape: dim {dim}, {num_heads} heads, {num_kv_heads} kv heads, head dim "
                         f"{head_dim}, ffn {ffn_dim}, vocab {vocab_size}, {num_layers} layers")
    if arch == "llama3" and dim != num_heads * head_dim:
        raise ValueError(f"llama3 needs dim = heads x head dim, got {dim} != {num_heads} x {head_dim}")
    rope = dataclasses.replace(attention.rope, dim=head_dim,
                               max_seq_len=attention.rope.max_seq_len if max_seq_len is None else max_seq_len)
    common: dict[str, Any] = dict(n_layers=num_layers, dim=dim, n_heads=num_heads, n_kv_heads=num_kv_heads,
                                  hidden_dim=ffn_dim, rope=rope, attn_backend=attn_backend,
                                  fuse_qkv=isinstance(attention.qkv_linear, FusedQKVLinear.Config))
    if arch == "llama3":
        layers = family._build_llama3_layers(**common)
        lm_head = dataclasses.replace(config.lm_head, in_features=dim, out_features=vocab_size,
                                      param_init=family._output_linear_init(dim))
    else:
        layers = family._build_qwen3_layers(**common, head_dim=head_dim)
        lm_head = dataclasses.replace(config.lm_head, in_features=dim, out_features=vocab_size)
    return dataclasses.replace(
        config, dim=dim, vocab_size=vocab_size, layers=layers, lm_head=lm_head,
        tok_embeddings=dataclasses.replace(config.tok_embeddings, num_embeddings=vocab_size, embedding_dim=dim),
        norm=dataclasses.replace(config.norm, normalized_shape=dim))


def build_titan_model(config: Decoder.Config, *, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32, meshes: TitanMeshes | None = None,
                      param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> Decoder:
    """Build ``config`` the way torchtitan's trainer does, with flashcp attention; returns the model in train mode.

    On the meta device under ``dtype``, ``apply_cp_attention``, then ``to_empty(device)`` and torchtitan's
    ``init_weights`` (from torch's global RNG: seed it for the same weights on every rank). RoPE's cache
    stays in float32, as torchtitan computes it. With ``meshes`` the model is FSDP2-sharded on the meta
    device first (``shard_titan_model``, with ``param_dtype`` / ``reduce_dtype``), so only this rank's
    shards are ever materialised, as in torchtitan's trainer; the initial weights then come from
    torchtitan's initialisers on the shards (DTensor random ops), not from an unsharded draw. Without
    ``meshes`` the whole model is built and initialised on ``device``; shard it afterwards if needed.
    """
    with torch.device("meta"), set_default_dtype(dtype):
        model = config.build()
    apply_cp_attention(model)
    if meshes is not None:
        shard_titan_model(model, meshes, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def titan_inputs(batch: Batch, attn: CPAttention) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(tokens_BT, labels_BT, extra)`` for ``model(tokens_BT, **extra)`` and torchtitan's loss.

    ``extra`` holds ``positions`` (the per-document ``position_ids``, for RoPE) and ``attention_masks``
    (``attn``, for ``CPInnerAttention``); tokens and labels are this rank's, as a batch of one. The labels
    already point at the next token of the same document (-100 at a document's last token), also across a
    shard boundary, so the loss takes them as they are, unshifted.
    """
    return batch.input_ids[None], batch.labels[None], {"positions": batch.position_ids[None], "attention_masks": attn}


def make_titan_loss_sum(loss_fn: BaseLoss | None = None) -> LossSumFn:
    """A ``train_step`` loss hook: ``loss_fn`` (default torchtitan's ``CrossEntropyLoss``) summed over this rank.

    ``loss_fn(pred_BTV, labels_BT)`` must return ``(sum over the labels, metrics)``, as torchtitan's losses
    do without ``global_valid_tokens``; ``train_step`` divides by the global batch's label tokens.
    """
    loss = CrossEntropyLoss.Config().build() if loss_fn is None else loss_fn

    def loss_sum(model: nn.Module, batch: Batch, attn: CPAttention) -> torch.Tensor:
        tokens_BT, labels_BT, extra = titan_inputs(batch, attn)
        total, _ = loss(model(tokens_BT, **extra), labels_BT)
        return total

    return loss_sum


titan_loss_sum = make_titan_loss_sum()
"""Summed next-token loss of a torchtitan decoder over this rank's labels (torchtitan's CrossEntropyLoss)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TitanMeshes:
    """The device meshes of a torchtitan parallelism config, laid out as torchtitan's ``ParallelDims``."""

    parallel_dims: ParallelDims
    """torchtitan's degrees, validated (``dp_shard`` -1 resolved); its own meshes are not built."""
    mesh: Any
    """``(dp, cp)`` DeviceMesh named ``("dp", "cp")``, ``dp = dp_replicate x dp_shard``: for
    ``CPLoader.from_mesh`` (torchtitan's ``batch`` and ``cp`` dimensions)."""
    fsdp_mesh: Any
    """torchtitan's FSDP2 mesh: ``("fsdp",)`` over ``dp_shard x cp``, or ``("dp_replicate", "fsdp")`` (HSDP)."""
    groups: ParallelGroups
    """The groups ``train_step`` uses (CP group, DP group for the label count, all ranks for the loss)."""

    @classmethod
    def from_parallelism(cls, parallelism: ParallelismConfig, *, device_type: str = "cpu",
                         world_size: int | None = None) -> TitanMeshes:
        """Meshes for ``parallelism`` over the ``world_size`` ranks (default: the whole default group).

        ``context_parallel_degree`` must be the plan's ``cp`` and the CP ranks consecutive, as torchtitan lays
        them out: world rank ``(replica * dp_shard + shard) * cp + cp_rank``. Tensor, pipeline and expert
        parallelism must be off. Built with ``device_type`` directly: torchtitan's ``ParallelDims.build_mesh``
        takes the device from ``torchtitan.tools.utils.device_type``, which is ``cuda`` on a machine without
        an accelerator. Raises ValueError for degrees that do not multiply to the world size.
        """
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size() if world_size is None else world_size
        others = {"tensor": parallelism.tensor_parallel_degree, "pipeline": parallelism.pipeline_parallel_degree,
                  "expert": parallelism.expert_parallel_degree}
        if any(d != 1 for d in others.values()):
            raise ValueError("flashcp trains with data and context parallelism only, got "
                             + ", ".join(f"{k} parallel degree {d}" for k, d in others.items() if d != 1))
        try:
            dims = ParallelDims.from_config(parallelism, world)
        except AssertionError as e:
            raise ValueError(f"torchtitan's parallel degrees do not fit {world} ranks: {e}") from None
        dp = dims.dp_replicate * dims.dp_shard
        world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
        mesh = world_mesh._unflatten(0, (dp, dims.cp), ("dp", "cp"))
        fsdp = world_mesh._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp), ("dp_replicate", "fsdp"))
        fsdp_mesh = fsdp if dims.dp_replicate > 1 else fsdp["fsdp"]
        return cls(parallel_dims=dims, mesh=mesh, fsdp_mesh=fsdp_mesh, groups=ParallelGroups.from_mesh(mesh))


def shard_titan_model(model: Decoder, mesh: TitanMeshes | Any, *, param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype | None = None) -> Decoder:
    """FSDP2 with torchtitan's ``apply_fsdp_to_decoder`` over ``mesh`` (a ``TitanMeshes`` or a DeviceMesh).

    Embeddings, each block, and norm plus head are wrapped as torchtitan wraps them; gradients are summed
    (torchtitan turns FSDP's division off, as ``train_step`` normalises by the global label count).
    ``param_dtype`` / ``reduce_dtype`` are the mixed-precision policy (default: the model's own dtype, i.e.
    none). Collectives are forced to plain sums, as in ``flashcp.train.parallel`` (gloo has no premultiplied
    sum). Build the optimizer after this call. Returns the model.
    """
    from torch.distributed.fsdp import FSDPModule

    fsdp_mesh = mesh.fsdp_mesh if isinstance(mesh, TitanMeshes) else mesh
    dtype = next(model.parameters()).dtype
    apply_fsdp_to_decoder(model, fsdp_mesh, param_dtype=param_dtype or dtype, reduce_dtype=reduce_dtype or dtype,
                          pp_enabled=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model
