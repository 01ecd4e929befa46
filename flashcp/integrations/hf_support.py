"""Which Hugging Face models flashcp trains exactly under CP, decided before the first step.

flashcp's CP is exact for two kinds of token mixing: causal attention inside each document, run through
``cp_attention`` with the plan's document mask, and the recurrent mixers of the hybrid models in
``CP_RECURRENT_MIXERS`` (Gated DeltaNet, Mamba-2, with their short convolutions) once
``flashcp.integrations.hf_recurrent.apply_cp_recurrent`` runs them through ``flashcp.runtime.recurrent``. A
decoder layer that mixes tokens any other way trains silently wrong under CP: a recurrent or state-space layer
(Gated DeltaNet, Mamba-2) or a short convolution run by its own code on a rank's tokens carries state across
document and shard boundaries and receives nothing from the ranks before; a layer kind the runtime does not
run, or an option or a bias passed to the attention function that it does not honour, would be dropped. The
loss of a random model barely moves (1e-4 relative), the parameter updates are wrong by 14% to 216% (issue 31's
table): the bug class that made accelerate refuse these models (accelerate #4177).

So acceptance is an allowlist, never a list of what is known to break:

1. ``VERIFIED_MODEL_TYPES``: the transformers architectures whose every layer is a kind ``cp_attention`` runs
   (full, sliding-window or chunked causal attention, with learned sinks or logit soft-capping, or token-local:
   MLP, mixture of experts, norms) and that train one step under CP equal to one process running each document
   alone (``tests/integrations/test_hf_support.py`` builds a tiny model of every ``*ForCausalLM`` architecture
   of the installed transformers and checks exactly that). Their config must still declare only those kinds:
   ``layer_types`` of full, sliding or chunked attention, chunks only on layers marked chunked. A hybrid of
   ``CP_RECURRENT_MIXERS`` is accepted with its recurrent layers (``linear_attention``, Nemotron-H's ``M``) only
   when every recurrent mixer of it runs flashcp's forward (``apply_cp_recurrent``; ``CPTrainer`` and
   ``hf_loss_sum`` apply it), and the attention function accepts its config only when the call carries a
   ``RecurrentMeta``.
2. Another architecture transformers knows is refused, naming its first layer flashcp does not run exactly
   (from the config's layer kinds, else the first module that mixes tokens outside attention), else saying it
   has not been verified.
3. An architecture transformers does not know (a model's own code) is accepted only when its config declares
   no other layer kind and every module of it is one flashcp knows to be token-local (linear, embedding, norm,
   activation, dropout, rotary embedding) or an attention module calling transformers' attention interface.

The attention function (``flashcp.integrations.hf.flashcp_attention_forward``) checks the calling layer's
config on its first call too and refuses any keyword argument that changes the result and that it does not
honour (``attention_kwarg_problem``), so a model that reaches it without ``check_hf_model`` is still refused at
its first layer, before any gradient.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["CP_RECURRENT_MIXERS", "HARMLESS_ATTENTION_KWARGS", "VERIFIED_MODEL_TYPES", "UnsupportedModelError",
           "attention_kwarg_problem", "check_hf_config", "check_hf_model", "recurrent_mixers"]

VERIFIED_MODEL_TYPES = frozenset({
    # dense decoders of full attention
    "apertus", "apertus1p5_text", "arcee", "bitnet", "cohere", "diffllama", "ernie4_5", "exaone", "gemma", "glm",
    "glm4", "gpt_bigcode", "gpt_neox", "granite", "helium", "hunyuan_v1_dense", "hyperclovax", "internlm3",
    "iquestcoder", "jais2", "laguna", "lfm2", "llama", "mistral", "nanochat", "olmo", "olmo2", "persimmon", "phi",
    "phi3", "qwen2", "qwen3", "seed_oss", "smollm3", "starcoder2",
    # mixtures of experts over full attention (routing is per token)
    "aria_text", "dots1", "ernie4_5_moe", "flex_olmo", "glm4_moe", "granitemoe", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "jetmoe", "mellum", "minimax_m2", "minimax_m3_vl_text", "mixtral", "olmoe",
    "qwen2_moe", "qwen3_moe", "sarvam_moe", "solar_open",
    # sliding-window, chunked, sink or soft-capped layers, which cp_attention runs
    "cohere2", "exaone4", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "ministral", "olmo3",
    # hybrids whose recurrent mixers flashcp runs (CP_RECURRENT_MIXERS, after apply_cp_recurrent)
    "nemotron_h", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
})
"""transformers ``model_type`` values flashcp trains exactly under CP (checked by the every-architecture test)."""

CP_RECURRENT_MIXERS: dict[str, dict[str, str]] = {
    "qwen3_next": {"Qwen3NextGatedDeltaNet": "gated_delta"},
    "qwen3_5_text": {"Qwen3_5GatedDeltaNet": "gated_delta"},
    "qwen3_5_moe_text": {"Qwen3_5MoeGatedDeltaNet": "gated_delta"},
    "nemotron_h": {"NemotronHMamba2Mixer": "mamba2"},
}
"""Per transformers ``model_type``: the recurrent mixer classes ``hf_recurrent.apply_cp_recurrent`` runs under CP
and the recurrence each computes (``gated_delta``: Gated DeltaNet; ``mamba2``: Mamba-2 SSD)."""

RECURRENT_KINDS = frozenset({"linear_attention", "M"})
"""Layer kinds (``layer_types`` entries, Nemotron-H's ``hybrid_override_pattern`` symbol) of those mixers."""

FULL_ATTENTION_KINDS = frozenset({"full_attention", "attention"})
"""Layer kinds (``layer_types`` / ``layers_block_type`` entries) that are causal full attention."""

ATTENTION_KINDS = FULL_ATTENTION_KINDS | {"sliding_attention", "chunked_attention"}
"""Layer kinds ``cp_attention`` runs: full, sliding-window (transformers passes the window to the attention
function) and chunked (``layer_chunk`` reads the chunk from the config)."""

TOKEN_LOCAL_KINDS = frozenset({"mlp", "moe"})
"""Layer kinds that mix no tokens (a layer of these holds no attention and no recurrence)."""

HARMLESS_ATTENTION_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "layer_idx",
})
"""Keyword arguments transformers hands to an attention function that do not change what it computes (RoPE
is applied before the call; flashcp keeps no cache). Any other keyword argument is accepted only when it is
None (an option switched off); ``is_causal`` only when true."""

_TOKEN_LOCAL_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.Dropout, nn.Identity,
                        nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Softplus)
_TOKEN_LOCAL_NAME_ENDINGS = ("RMSNorm", "LayerNorm", "Norm", "RotaryEmbedding", "Activation", "GELU", "SiLU",
                             "ReLU", "ScaledWordEmbedding")


class UnsupportedModelError(ValueError):
    """A model flashcp cannot train exactly under CP; the message is one sentence naming the layer and its kind."""


def check_hf_model(model: nn.Module) -> None:
    """Raise UnsupportedModelError unless flashcp trains ``model`` exactly under CP (module docstring).

    ``model`` is a transformers causal LM or a PEFT model over one.
    """
    get_base = getattr(model, "get_base_model", None)  # a PEFT model wraps the transformers one
    base = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    if config is None:
        raise UnsupportedModelError(f"flashcp trains transformers models (PreTrainedModel) under CP, got a "
                                    f"{type(base).__name__}")
    name = type(base).__name__
    model_type = _model_type(config)
    problem = _unswapped_mixer(base, model_type)
    recurrent = model_type in CP_RECURRENT_MIXERS and problem is None
    problem = problem or _config_problem(config, recurrent=recurrent)
    if problem is None and model_type not in VERIFIED_MODEL_TYPES:
        problem = _token_mixing_module(base)
        if problem is None and _known_to_transformers(model_type):
            problem = _unverified(model_type)
        elif problem is None:  # a model's own code: accepted when every module is plain
            problem = _unvouched_module(base)
    if problem is not None:
        raise UnsupportedModelError(f"{name} cannot train under flashcp context parallelism: {problem}")


def check_hf_config(config: Any, *, recurrent: bool = False) -> None:
    """The config half of ``check_hf_model``, for callers that see only a layer's config (the attention function).

    Layer kinds, windows, chunks, latent attention, soft-capping and the architecture. ``recurrent``: the call
    carries a RecurrentMeta, so the recurrent layers of a ``CP_RECURRENT_MIXERS`` type are accepted.
    """
    problem = _config_problem(config, recurrent=recurrent and _model_type(config) in CP_RECURRENT_MIXERS)
    model_type = _model_type(config)
    if problem is None and model_type not in VERIFIED_MODEL_TYPES and _known_to_transformers(model_type):
        problem = _unverified(model_type)
    if problem is not None:
        raise UnsupportedModelError(f"a {model_type or 'transformers'} model cannot train under flashcp context "
                                    f"parallelism: {problem}")


def layer_chunk(module: nn.Module | None) -> int | None:
    """The chunk length of the calling attention layer, or None when it is not chunked.

    ``attention_chunk_size`` when its config marks the layer ``chunked_attention``: transformers builds a chunk
    mask for it and passes no chunk to the attention function.
    """
    config = getattr(module, "config", None)
    index = getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    if config is None or index is None or not kinds or kinds[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)


def attention_kwarg_problem(name: str, value: Any) -> str | None:
    """Why the attention function must refuse keyword argument ``name=value``, or None when it is harmless."""
    if name in HARMLESS_ATTENTION_KWARGS or value is None:
        return None
    if name == "is_causal" and value is True:
        return None
    if name == "dropout" and not value:
        return None
    shown = f"a {type(value).__name__}" if hasattr(value, "shape") else repr(value)
    return f"cp_attention cannot honour the attention argument {name}={shown}; " + _KWARG_HINTS.get(
        name, "flashcp computes plain causal attention inside each document and would drop it")


_KWARG_HINTS = {
    "dropout": "set the config's attention_dropout to 0",
    "is_causal": "flashcp computes causal attention only",
}


# ---- the checks ------------------------------------------------------------------------------------------------


def _model_type(config: Any) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", "") or getattr(config, "model_type", "") or "")


def _known_to_transformers(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def _unverified(model_type: str) -> str:
    return (f"its architecture '{model_type}' is not among those verified to train exactly under flashcp CP "
            "(flashcp.integrations.hf_support.VERIFIED_MODEL_TYPES)")


def _config_problem(config: Any, *, recurrent: bool = False) -> str | None:
    """The first layer the config declares that flashcp does not run, else None.

    Accepted: attention, token-local layers and, with ``recurrent``, the recurrent layers of ``RECURRENT_KINDS``.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    accepted = ATTENTION_KINDS | TOKEN_LOCAL_KINDS | (RECURRENT_KINDS if recurrent else frozenset())
    hint = _recurrent_hint(_model_type(config))
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text, field, None)
        for index, kind in enumerate(kinds or ()):
            if kind not in accepted:
                return (f"layer {index} is {kind} ({field}), and flashcp runs layers of full, sliding-window or "
                        f"chunked attention only{hint}")
    pattern = getattr(text, "hybrid_override_pattern", None)
    for index, symbol in enumerate(pattern or ""):
        if symbol not in "*-E" and symbol not in accepted:  # Nemotron-H: * attention, - MLP, E MoE, M Mamba-2
            return (f"layer {index} is '{symbol}' in hybrid_override_pattern (a state-space layer), and flashcp "
                    f"runs layers of full attention only{hint}")
    for field in ("attn_layer_indices", "attn_layer_period", "hybrid_layer_ids"):
        if getattr(text, field, None) is not None:  # attention on some layers only: the others are recurrent
            return (f"its config sets {field} (attention on some layers, recurrent or convolution layers on the "
                    "others), and flashcp runs layers of full attention only")
    kinds = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "attention_chunk_size", None) is not None and "chunked_attention" not in kinds:
        return (f"its attention is chunked (attention_chunk_size={text.attention_chunk_size}) on layers its config "
                "does not mark chunked_attention, and flashcp reads the chunk from layer_types")
    no_rope = list(getattr(text, "no_rope_layers", None) or ())[:getattr(text, "num_hidden_layers", None)]
    if getattr(text, "attn_temperature_tuning", False) and 0 in no_rope:
        # Llama 4: log1p(floor((i + 1) / floor_scale)) with i = arange(tokens), never the position_ids
        return (f"layer {no_rope.index(0)} has no RoPE and scales its queries by a temperature of each token's "
                "index in the rank's packed tokens, not its position in the document (attn_temperature_tuning), "
                "which CP changes once an index passes floor_scale")
    if getattr(text, "kv_lora_rank", None) is not None:
        return (f"layer 0 is multi-head latent attention (kv_lora_rank={text.kv_lora_rank}), whose query/key and "
                "value heads differ in size, and flashcp runs standard multi-head and grouped-query attention only")
    return None


def _recurrent_hint(model_type: str) -> str:
    if model_type not in CP_RECURRENT_MIXERS:
        return ""
    return (" until flashcp.integrations.hf_recurrent.apply_cp_recurrent(model) runs its recurrent layers and the "
            "call passes hf_attention_kwargs(..., recurrent=...)")


def recurrent_mixers(model: nn.Module):
    """``(path, module)`` of every module of ``model`` whose class is a recurrent mixer in ``CP_RECURRENT_MIXERS``."""
    names = {name for kinds in CP_RECURRENT_MIXERS.values() for name in kinds}
    for path, module in model.named_modules():
        if type(module).__name__ in names:
            yield path, module


def _unswapped_mixer(model: nn.Module, model_type: str) -> str | None:
    if model_type not in CP_RECURRENT_MIXERS:
        return None
    for path, module in recurrent_mixers(model):
        if not getattr(module, "_flashcp_recurrent", False):
            return (f"module {path} is a {type(module).__name__}, a recurrent layer that transformers' own forward "
                    "would run on each rank's tokens alone; run flashcp.integrations.hf_recurrent."
                    "apply_cp_recurrent(model) first (CPTrainer and hf_loss_sum apply it)")
    return None


def _token_mixing_module(model: nn.Module) -> str | None:
    # a convolution, or an attention module holding parameters beside its projections (learned sinks, decays)
    for path, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            return f"module {path} is a {type(module).__name__}, a convolution over tokens outside attention"
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own and _is_attention(module):
            return (f"attention module {path} ({type(module).__name__}) holds parameters of its own "
                    f"({', '.join(own[:3])}) beside its projections, such as learned sinks or decays, that flashcp "
                    "does not run")
    return None


def _unvouched_module(model: nn.Module) -> str | None:
    # a leaf or a holder of parameters that is not a known token-local kind (linear, embedding, norm, activation,
    # dropout, rotary embedding)
    for path, module in model.named_modules():
        if _is_token_local(module) or _is_attention(module):
            continue
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own or not list(module.children()):
            held = f" holding its own parameters ({', '.join(own[:3])})" if own else ""
            return (f"module {path or '(the model)'} is a {type(module).__name__}{held}, not a kind flashcp knows to "
                    "be token-local or plain attention")
    return None


def _is_token_local(module: nn.Module) -> bool:
    kind = type(module)
    return (isinstance(module, _TOKEN_LOCAL_MODULES) or kind.__name__.endswith(_TOKEN_LOCAL_NAME_ENDINGS)
            or kind.__module__ in ("transformers.activations", "torch.nn.modules.activation"))


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention") and hasattr(module, "config")
