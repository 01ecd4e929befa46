"""Hugging Face hybrid models under CP: their recurrent mixers run through ``flashcp.runtime.recurrent``.

Qwen3-Next and Qwen3.5 (Gated DeltaNet layers beside gated full attention) and Nemotron-H (Mamba-2 layers beside
attention and MLP / MoE blocks) mix tokens in their recurrent layers with a short causal convolution and a
recurrence. Run on a rank's packed tokens, transformers' own forward carries both across document and shard
boundaries and receives nothing from the ranks before (``hf_support``). ``apply_cp_recurrent(model)`` replaces
the forward of each such mixer by one that computes the same math as the module's pure-PyTorch path
(projections, the depthwise convolution and its activation, the layer's parameterisation of the recurrence,
the gated norm and the output projection) with ``cp_causal_conv1d`` and ``cp_gated_delta_rule`` / ``cp_ssd``
over the batch's ``RecurrentMeta``: each document starts from zero state and zero convolution inputs, a piece
split off a document starts from the state and the last inputs the pieces before it leave, on whichever rank.

The meta reaches the mixer as a keyword argument of the model's forward, which the decoder layers hand on to
their mixers (and attention layers to the attention function)::

    apply_cp_recurrent(model)                     # CPTrainer and hf_loss_sum do this themselves
    out = model(input_ids=..., position_ids=..., use_cache=False,
                **hf_attention_kwargs(batch.attn, group=group, recurrent=batch.recurrent()))

A swapped mixer called without any flashcp argument runs transformers' own forward (generation with a cache,
a plain forward); one called with the attention meta but no recurrent meta is refused, never run per rank.

The parameterisations (transformers 5.x, ``modeling_qwen3_next.py`` / ``modeling_qwen3_5.py`` /
``modeling_nemotron_h.py``):

- Gated DeltaNet: ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32), q and k
  L2-normalised, q scaled by ``K ** -0.5``, 64-token chunks; output ``RMSNormGated(o, z)`` then ``out_proj``.
- Mamba-2: ``dt = clamp(softplus(dt + dt_bias), time_step_min)`` in the input dtype, ``A = -exp(A_log)``, the
  skip ``D x``, the scan in float32 over the config's ``chunk_size``; output ``RMSNormGated(y, gate)`` on the
  float32 scan output, cast to the input dtype before ``out_proj``.

Shape legend: ``T`` this rank's tokens (the model's batch is 1), ``F`` convolution channels, ``Hk`` key heads,
``H`` value / SSM heads, ``K`` key dim, ``V`` value dim, ``P`` SSM head dim, ``G`` B/C groups, ``S`` state size.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashcp.integrations.hf_support import (
    CP_RECURRENT_MIXERS,
    HARMLESS_ATTENTION_KWARGS,
    UnsupportedModelError,
    recurrent_mixers,
)
from flashcp.runtime.comm import CommStats
from flashcp.runtime.recurrent import RecurrentMeta, cp_causal_conv1d, cp_gated_delta_rule, cp_ssd

__all__ = ["apply_cp_recurrent", "uses_cp_recurrent"]

GDN_CHUNK = 64
"""Tokens per chunk of the Gated DeltaNet scan (transformers' ``torch_chunk_gated_delta_rule`` default)."""


def apply_cp_recurrent(model: nn.Module) -> int:
    """Run every recurrent mixer of ``model`` under CP from now on (module docstring); returns how many.

    ``model`` is a transformers model (or a PEFT model over one) of a type in
    ``hf_support.CP_RECURRENT_MIXERS``; other models are left as they are (0). Idempotent.
    """
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    count = 0
    for _, mixer in recurrent_mixers(base):
        if getattr(mixer, "_flashcp_recurrent", False):
            count += 1
            continue
        kind = _kind(mixer)
        original = mixer.forward
        forward = _gated_delta_forward if kind == "gated_delta" else _mamba2_forward
        # plain attributes: nothing enters the state dict
        object.__setattr__(mixer, "_flashcp_original_forward", original)
        object.__setattr__(mixer, "forward", types.MethodType(forward, mixer))
        object.__setattr__(mixer, "_flashcp_recurrent", True)
        count += 1
    return count


def uses_cp_recurrent(model: nn.Module) -> bool:
    """True when ``model`` holds a mixer ``apply_cp_recurrent`` swaps (its batches need a RecurrentMeta)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return any(True for _ in recurrent_mixers(base))


def _kind(mixer: nn.Module) -> str:
    for kinds in CP_RECURRENT_MIXERS.values():
        if type(mixer).__name__ in kinds:
            return kinds[type(mixer).__name__]
    raise AssertionError(f"{type(mixer).__name__} is not a recurrent mixer flashcp runs")


def _cp_arguments(mixer: nn.Module, hidden_states: torch.Tensor, cache, attention_mask,
                  kwargs: dict[str, Any]) -> tuple[RecurrentMeta, Any, CommStats | None] | None:
    """``(meta, group, stats)`` for a CP call, None for a plain call (no flashcp argument); refuses what it cannot run.

    ``stats``: the ``flashcp_stats`` CommStats the attention layers record into; this layer's all-to-alls are
    recorded there too (None: not recorded).
    """
    meta = kwargs.pop("flashcp_recurrent", None)
    group = kwargs.pop("flashcp_group", None)
    attn_meta = kwargs.pop("flashcp_meta", None)
    stats = kwargs.pop("flashcp_stats", None)
    for name in ("flashcp_comm", "flashcp_backend"):
        kwargs.pop(name, None)
    if meta is None and attn_meta is None:
        return None
    where = f"{type(mixer).__name__} (layer {getattr(mixer, 'layer_idx', '?')})"
    if meta is None:
        raise ValueError(f"{where} is a recurrent layer and needs this rank's RecurrentMeta under CP: call the model "
                         "with **hf_attention_kwargs(batch.attn, group=..., recurrent=batch.recurrent())")
    if cache is not None:
        raise ValueError(f"{where} runs under CP without a cache; call the model with use_cache=False")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{where} takes the documents from the plan and its tokens have no padding; call the model "
                         "without attention_mask")
    if hidden_states.shape[0] != 1:
        raise ValueError(f"{where} takes a rank's tokens as one row (batch size 1), got batch size "
                         f"{hidden_states.shape[0]}")
    for name, value in kwargs.items():
        if name not in HARMLESS_ATTENTION_KWARGS and value is not None:
            raise UnsupportedModelError(f"{where} cannot honour the argument {name} under flashcp CP, which runs "
                                        "each document of the plan from zero state")
    return meta, group, stats


def _gated_delta_forward(self: Any, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """Qwen3-Next / Qwen3.5 ``GatedDeltaNet.forward`` over this rank's pieces (module docstring)."""
    cp = _cp_arguments(self, hidden_states, cache, attention_mask, kwargs)
    if cp is None:
        return self._flashcp_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    meta, group, stats = cp
    x_TD = hidden_states[0]
    if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: q, k, v, z and b, a interleaved per key head
        query, key, value, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(x_TD)[None],
                                                                       self.in_proj_ba(x_TD)[None])
        mixed_TF = torch.cat([t[0].reshape(t.shape[1], -1) for t in (query, key, value)], dim=-1)
        z_THV, b_TH, a_TH = z[0], b[0], a[0]
    else:  # Qwen3.5: one projection each
        mixed_TF = self.in_proj_qkv(x_TD)
        z_THV = self.in_proj_z(x_TD).reshape(x_TD.shape[0], -1, self.head_v_dim)
        b_TH, a_TH = self.in_proj_b(x_TD), self.in_proj_a(x_TD)
    if self.activation not in ("silu", "swish"):
        raise UnsupportedModelError(f"{type(self).__name__} (layer {self.layer_idx}) uses the convolution "
                                    f"activation {self.activation}, and flashcp runs silu only")
    mixed_TF = cp_causal_conv1d(mixed_TF, self.conv1d.weight.squeeze(1), self.conv1d.bias, meta, group,
                                activation="silu", stats=stats)
    q_TF, k_TF, v_TF = torch.split(mixed_TF, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    num_tokens = x_TD.shape[0]
    beta_TH = b_TH.sigmoid()
    g_TH = -self.A_log.float().exp() * F.softplus(a_TH.float() + self.dt_bias)
    out_THV = cp_gated_delta_rule(q_TF.reshape(num_tokens, -1, self.head_k_dim),
                                  k_TF.reshape(num_tokens, -1, self.head_k_dim),
                                  v_TF.reshape(num_tokens, -1, self.head_v_dim), g_TH, beta_TH, meta, group,
                                  chunk_size=GDN_CHUNK, use_qk_l2norm=True, stats=stats)
    out = self.norm(out_THV.reshape(-1, self.head_v_dim), z_THV.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(1, num_tokens, -1))


def _mamba2_forward(self: Any, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """Nemotron-H ``Mamba2Mixer.forward`` (its ``torch_forward`` path) over this rank's pieces (module docstring)."""
    cp = _cp_arguments(self, hidden_states, cache, attention_mask, kwargs)
    if cp is None:
        return self._flashcp_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    meta, group, stats = cp
    dtype = hidden_states.dtype
    projected = self.in_proj(hidden_states[0])
    gate_TF, xbc_TF, dt_TH = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    if self.activation not in ("silu", "swish"):
        raise UnsupportedModelError(f"{type(self).__name__} (layer {self.layer_idx}) uses the convolution "
                                    f"activation {self.activation}, and flashcp runs silu only")
    xbc_TF = cp_causal_conv1d(xbc_TF, self.conv1d.weight.squeeze(1), self.conv1d.bias, meta, group,
                              activation="silu", stats=stats)
    state = self.n_groups * self.ssm_state_size
    x_TF, B_TF, C_TF = torch.split(xbc_TF, [self.intermediate_size, state, state], dim=-1)
    num_tokens = x_TF.shape[0]
    # transformers' mamba2_chunk_scan: bias, softplus and clamp in the input dtype, the scan in float32
    dt_TH = F.softplus(dt_TH + self.dt_bias.to(dt_TH.dtype))
    dt_TH = torch.clamp(dt_TH, min=self.time_step_limit[0], max=self.time_step_limit[1])
    A_H = -torch.exp(self.A_log.float())
    y_THP = cp_ssd(x_TF.float().reshape(num_tokens, self.num_heads, self.head_dim), dt_TH, A_H,
                   B_TF.reshape(num_tokens, self.n_groups, self.ssm_state_size),
                   C_TF.reshape(num_tokens, self.n_groups, self.ssm_state_size), meta, group, D_H=self.D,
                   chunk_size=self.chunk_size, stats=stats)
    y = self.norm(y_THP.reshape(1, num_tokens, -1), gate_TF[None])
    return self.out_proj(y.to(dtype))
