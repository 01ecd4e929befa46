"""Hugging Face transformers: run a stock causal LM (Llama, Qwen2, ...) with flashcp context parallelism.

``register_flashcp_attention()`` adds flashcp to transformers' attention interface under the name
``"cp_attention"`` (a name containing "flash" would be taken by transformers for a flash-attention kernel to
load from the hub). A model built with ``attn_implementation="cp_attention"`` then attends through
``cp_attention``; the forward call passes this rank's packed tokens as a batch of one, the per-document
``position_ids`` (the model computes RoPE from them, so every document starts at position 0 even when its
shard starts mid-document on this rank), and the batch's CPAttnMeta, which transformers hands on to the
attention function as a keyword argument::

    register_flashcp_attention()
    model = LlamaForCausalLM._from_config(config, attn_implementation="cp_attention")
    if not getattr(model, "_flashcp_checked", False):
        check_hf_model(model)
        model._flashcp_checked = True  # a plain attribute: not in the state dict
    out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                **hf_attention_kwargs(batch.attn, group=group, comm="a2a"))

The document mask comes from the plan, never from an ``attention_mask``: transformers builds no mask for an
attention implementation it has no mask function for, and the attention function refuses one passed in.

The Hugging Face ``Trainer`` with flashcp CP is ``CPTrainer`` (and TRL's ``SFTTrainer``, ``CPSFTTrainer``), in
``flashcp.integrations.hf_trainer`` (which builds on this module, not the other way round).

Shape legend: ``B`` batch (always 1: a rank's packed sequences, several run as one by
``flashcp.runtime.batching.concat_batches``), ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads,
``D`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flashcp.integrations.hf_recurrent import apply_cp_recurrent, uses_cp_recurrent
from flashcp.integrations.hf_support import (
    UnsupportedModelError,
    attention_kwarg_problem,
    check_hf_config,
    check_hf_model,
    layer_chunk,
)
from flashcp.runtime import CommStats, CPAttention, CPAttnMeta, cp_attention
from flashcp.runtime.loader import Batch
from flashcp.runtime.recurrent import RecurrentMeta
from flashcp.train.loss import causal_lm_loss_sum

__all__ = ["ATTN_IMPLEMENTATION", "HF_ARCHITECTURES", "CPTrainer", "flashcp_attention_forward",  # noqa: F822
           "hf_attention_kwargs", "hf_loss_sum", "register_flashcp_attention", "tiny_hf_model"]

ATTN_IMPLEMENTATION = "cp_attention"
"""The name flashcp registers in transformers' AttentionInterface."""

HF_ARCHITECTURES = ("llama", "qwen2", "qwen3_next", "qwen3_5", "nemotron_h")
"""Architectures ``tiny_hf_model`` builds: Llama and Qwen2 (grouped-query attention), and the hybrids whose
recurrent layers flashcp runs (``hf_recurrent``): Qwen3-Next and Qwen3.5 (Gated DeltaNet layers, gated full
attention on every fourth layer and the last), Nemotron-H (Mamba-2, attention and MLP blocks in turn)."""


def register_flashcp_attention(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register ``flashcp_attention_forward`` with transformers under ``name``; returns the name.

    Idempotent. Raises ValueError for a name containing "flash", which transformers would try to load as a
    flash-attention kernel.
    """
    if "flash" in name:
        raise ValueError(f"attention implementation name '{name}' contains 'flash', which transformers "
                         "reserves for flash-attention kernels; choose another name")
    from transformers import AttentionInterface

    AttentionInterface.register(name, flashcp_attention_forward)
    return name


def hf_attention_kwargs(meta: CPAttnMeta, *, group=None, comm: str = "auto", backend: str = "auto",
                        stats: CommStats | None = None, recurrent: RecurrentMeta | None = None) -> dict[str, Any]:
    """Keyword arguments for a transformers model's forward that make it attend with ``cp_attention``.

    ``recurrent``: this rank's RecurrentMeta of the batch (``batch.recurrent()``), which a hybrid model's recurrent
    mixers need (``flashcp.integrations.hf_recurrent``); None for a model of attention layers only.
    """
    return {"flashcp_meta": meta, "flashcp_group": group, "flashcp_comm": comm, "flashcp_backend": backend,
            "flashcp_stats": stats, "flashcp_recurrent": recurrent}


def flashcp_attention_forward(module: nn.Module | None, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                              *, flashcp_meta: CPAttnMeta | None = None, flashcp_group=None,
                              flashcp_comm: str = "auto", flashcp_backend: str = "auto",
                              flashcp_stats: CommStats | None = None, flashcp_recurrent: RecurrentMeta | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """Attention function for transformers: ``cp_attention`` on this rank's packed tokens.

    Args:
        module: the calling attention layer; on its first call its config is checked
            (``hf_support.check_hf_config``: layer kinds, windows, chunks, soft-capping, architecture).
        query: (1, H, T, D), RoPE applied.
        key: (1, K, T, D), RoPE applied; ``H % K == 0``.
        value: (1, K, T, D).
        attention_mask: must be None (the document mask comes from the plan).
        scaling: the softmax scale (passed to the kernels; None means ``1 / sqrt(D)``).
        flashcp_meta: this rank's CPAttnMeta (``batch.attn``); required.
        flashcp_group: the CP process group (None: the default group).
        flashcp_comm: ``allgather``, ``a2a``, ``full`` or ``auto``.
        flashcp_backend: ``flash_attn``, ``torch_varlen``, ``reference`` or ``auto``.
        flashcp_stats: a CommStats recording the collectives, or None.
        flashcp_recurrent: the batch's RecurrentMeta for a hybrid's recurrent mixers (``hf_recurrent``); here it
            only lets the config check accept their layer kinds.
        **kwargs: the layer's other arguments. ``sliding_window`` (transformers passes it to sliding layers
            only), learned sinks ``s_aux`` (or ``sinks``) and ``softcap`` are honoured (``cp_attention``'s
            window, sinks and softcap); a layer the config marks ``chunked_attention`` attends within chunks of
            ``attention_chunk_size``. Those that do not change the result (``position_ids``, ``use_cache``, ...,
            ``hf_support.HARMLESS_ATTENTION_KWARGS``) and options switched off (None, ``dropout=0``,
            ``is_causal=True``) are accepted; any other (attention dropout, a bias, ...) is refused, never
            dropped.

    Returns ``(out, None)`` with ``out`` (1, T, H, D). Raises ValueError (``UnsupportedModelError`` for the
    model's own settings) with one sentence.
    """
    if module is not None and not getattr(module, "_flashcp_checked", False):
        config = getattr(module, "config", None)
        if config is not None:
            check_hf_config(config, recurrent=flashcp_recurrent is not None)
        object.__setattr__(module, "_flashcp_checked", True)  # a plain attribute: not in the state dict
    kind = {"window": kwargs.pop("sliding_window", None), "softcap": kwargs.pop("softcap", None),
            "chunk": layer_chunk(module)}
    sinks = kwargs.pop("s_aux", None)
    if sinks is None:
        sinks = kwargs.pop("sinks", None)
    for name, option in kwargs.items():
        problem = attention_kwarg_problem(name, option)
        if problem is not None:
            raise UnsupportedModelError(problem)
    if flashcp_meta is None:
        raise ValueError("the cp_attention implementation needs this rank's CPAttnMeta: call the model with "
                         "**hf_attention_kwargs(batch.attn, group=...)")
    if query.shape[0] != 1:
        raise ValueError(f"cp_attention takes a rank's tokens as one row (batch size 1; run several packed "
                         f"sequences as one with flashcp.runtime.batching.concat_batches), got batch size "
                         f"{query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("cp_attention takes the document mask from the plan; call the model without "
                         "attention_mask")
    out_THD = cp_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                           flashcp_meta, group=flashcp_group, comm=flashcp_comm, backend=flashcp_backend,
                           stats=flashcp_stats, softmax_scale=scaling, sinks=sinks, **kind)
    return out_THD[None], None


def hf_loss_sum(model: nn.Module, batch: Batch, attn: CPAttention) -> torch.Tensor:
    """Summed next-token loss of a transformers causal LM over this rank's labels (``train_step``'s hook).

    The labels come from the batch (next token inside the same document, -100 at a document's end), not
    from the model, whose own loss would shift the rank-local tokens and cross shard boundaries. The model is
    checked on its first call (``check_hf_model``): one flashcp cannot train exactly under CP is refused
    before any gradient.
    """
    if not getattr(model, "_flashcp_checked", False):
        apply_cp_recurrent(model)  # a hybrid's recurrent mixers run through flashcp.runtime.recurrent
        check_hf_model(model)
        object.__setattr__(model, "_flashcp_checked", True)  # a plain attribute: not in the state dict
    recurrent = batch.recurrent() if uses_cp_recurrent(model) else None
    out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], use_cache=False,
                **hf_attention_kwargs(attn.meta, group=attn.group, comm=attn.comm, backend=attn.backend,
                                      stats=attn.stats, recurrent=recurrent))
    return causal_lm_loss_sum(out.logits[0], batch.labels)


def tiny_hf_model(arch: str, *, vocab_size: int, dim: int, num_layers: int, num_heads: int, num_kv_heads: int,
                  ffn_dim: int, dtype: torch.dtype = torch.float32,
                  attn_implementation: str = ATTN_IMPLEMENTATION) -> nn.Module:
    """A small randomly initialised causal LM of ``arch`` (``HF_ARCHITECTURES``; nothing is downloaded).

    Initialised from torch's global RNG (seed it for identical weights on every rank). With the default
    ``attn_implementation`` flashcp is registered first. The hybrids' recurrent layers take their sizes from the
    attention's: Gated DeltaNet ``num_kv_heads`` key heads and ``num_heads`` value heads of ``dim // num_heads``;
    Mamba-2 ``num_heads`` heads of ``2 * dim // num_heads``, ``num_kv_heads`` B/C groups, state 16, chunks of
    64 tokens; both with a convolution of 4 taps. Dense MLPs only (no experts).
    """
    if attn_implementation == ATTN_IMPLEMENTATION:
        register_flashcp_attention()
    shape: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=dim, intermediate_size=ffn_dim,
                                 num_hidden_layers=num_layers, num_attention_heads=num_heads,
                                 num_key_value_heads=num_kv_heads, max_position_embeddings=1 << 20,
                                 attention_dropout=0.0, tie_word_embeddings=False)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM._from_config(LlamaConfig(**shape), attn_implementation=attn_implementation,
                                              dtype=dtype)
    elif arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM._from_config(Qwen2Config(**shape, use_sliding_window=False),
                                              attn_implementation=attn_implementation, dtype=dtype)
    elif arch in ("qwen3_next", "qwen3_5", "nemotron_h"):
        model = _tiny_hybrid(arch, shape, dtype, attn_implementation)
    else:
        raise ValueError(f"unknown architecture '{arch}' (choose from {', '.join(HF_ARCHITECTURES)})")
    return model.train()


def _tiny_hybrid(arch: str, shape: dict[str, Any], dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    layers, heads, kv_heads = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    if arch == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM

        blocks = [("mamba", "attention", "mlp")[i % 3] for i in range(layers)]
        config: Any = NemotronHConfig(**{k: v for k, v in shape.items() if k != "num_hidden_layers"},
                                      layers_block_type=blocks, head_dim=head_dim, mamba_num_heads=heads,
                                      mamba_head_dim=2 * head_dim, n_groups=kv_heads, ssm_state_size=16,
                                      conv_kernel=4, chunk_size=64)
        return NemotronHForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    kinds = ["full_attention" if i % 4 == 3 or (i == layers - 1 and layers < 4) else "linear_attention"
             for i in range(layers)]
    linear = dict(head_dim=head_dim, layer_types=kinds, linear_num_key_heads=kv_heads, linear_num_value_heads=heads,
                  linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextForCausalLM._from_config(Qwen3NextConfig(**shape, **linear, num_experts=0),
                                                 attn_implementation=attn_implementation, dtype=dtype)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**shape, **linear),
                                           attn_implementation=attn_implementation, dtype=dtype)

