"""A tiny model of every ``*ForCausalLM`` architecture of the installed transformers, and one CP training step.

``tiny_model`` builds an architecture from its default config shrunk to a few layers of width 64 (the usual
size fields overridden where the config has them; windows and chunks of 256 tokens, shorter than the test's
documents). ``cp_step_error`` runs one training step of it under flashcp CP on this gloo rank (2 ranks, a plan
that splits documents across them, one of them head on rank 1 and tail on rank 0) and returns the largest
gradient error relative to that parameter's largest gradient against one process running every document alone
through the same weights with transformers' eager attention and the model's own position handling (loss:
summed next-token cross-entropy / label count). The gradients are the parameter update of one SGD step with
learning rate 1.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.distributed as dist

from flashcp.integrations.hf import hf_attention_kwargs, register_flashcp_attention
from flashcp.integrations.hf_recurrent import apply_cp_recurrent, uses_cp_recurrent
from flashcp.planner.plan import SequencePlan
from flashcp.runtime import CPAttnMeta
from flashcp.runtime.loader import IGNORE_INDEX
from flashcp.runtime.meta import rank_token_positions
from flashcp.runtime.recurrent import RecurrentMeta
from flashcp.train.loss import causal_lm_loss_sum

WINDOW = 256
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, n_embd=64, n_layer=2, n_head=4, d_model=64,
    n_positions=8192, ffn_dim=128, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
    num_experts_per_tok=2, n_routed_experts=4, shared_expert_intermediate_size=32, n_shared_experts=1,
    attention_dropout=0.0, hidden_dropout=0.0, dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
    ssm_state_size=16, mamba_d_state=16, n_groups=1, mamba_n_groups=1, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, time_step_rank=8,
    intermediate_size_mlp=128, attention_chunk_size=WINDOW, sliding_window=WINDOW, expand=2, state_size=16,
    conv_kernel=4, mamba_num_heads=8, mamba_head_dim=16, chunk_size=64, mamba_chunk_size=64)
MAX_PARAMETERS = 5_000_000

# documents longer than the windows and chunks; rank 0 holds 1,024 tokens, rank 1 the other 1,024
DOC_LENS = np.array([300, 420, 180, 600, 300, 248])
PLAN = SequencePlan.from_arrays(
    shard_doc=[0, 1, 3, 5, 1, 2, 3, 4, 5], shard_start=[0, 0, 300, 0, 200, 0, 0, 0, 224],
    shard_len=[300, 200, 300, 224, 220, 180, 300, 300, 24], shard_rank=[0, 0, 0, 0, 1, 1, 1, 1, 1], cp=2)


class Unbuildable(Exception):
    """The architecture cannot be built small from its default config on CPU."""


def causal_lm_architectures() -> list[tuple[str, str]]:
    """(model_type, class name) of every ``*ForCausalLM`` in transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted((model_type, name) for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
                  if isinstance(name, str) and name.endswith("ForCausalLM"))


def tiny_config(model_type: str, **overrides):
    """The architecture's default config with the SMALL fields it has, and ``overrides``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for key, value in {**SMALL, **overrides}.items():
        if key == "head_dim" and getattr(config, "qk_rope_head_dim", None) is not None:
            value = SMALL["qk_rope_head_dim"]  # latent attention: RoPE runs on the rope part only
        if hasattr(config, key):
            try:
                setattr(config, key, value)
            except Exception:  # a config that derives the field
                pass
    for key, value in vars(config).items():  # dropout would make the two runs differ by chance
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    _keep_every_layer_kind(config, overrides)
    return config


def _keep_every_layer_kind(config, overrides) -> None:
    """Shrink the layer list to one layer of each kind the architecture mixes (in order of first use)."""
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(config, field, None)
        if not kinds or field in overrides or not isinstance(kinds, list):
            continue
        distinct = list(dict.fromkeys(kinds))
        try:
            setattr(config, field, distinct)
            config.num_hidden_layers = max(len(distinct), 1)
        except AttributeError:  # derived from other fields
            pass


def tiny_model(model_type: str, class_name: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A small randomly initialised model of the architecture (eager attention), weights from ``seed``."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = tiny_config(model_type, **overrides)
            cls = getattr(transformers, class_name)
            with torch.device("meta"):
                size = sum(p.numel() for p in cls._from_config(config).parameters())
            if size > MAX_PARAMETERS:
                raise Unbuildable(f"{size:,} parameters at the smallest config tried")
            ids = torch.arange(3, 19)[None] % config.get_text_config().vocab_size
            for kind in (dtype, torch.float32):  # grouped-GEMM experts have no float64 kernel
                torch.manual_seed(seed)
                model = cls._from_config(config, attn_implementation="eager", dtype=kind)
                try:
                    model(input_ids=ids, use_cache=False)
                    break
                except RuntimeError as e:
                    if kind == torch.float32 or "Double" not in str(e):
                        raise
        except Unbuildable:
            raise
        except Exception as e:
            raise Unbuildable(f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None
    return model.train()


def sequence_tokens(vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (int(DOC_LENS.sum()),), generator=gen)


def document_labels(tokens: torch.Tensor) -> torch.Tensor:
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]
    return labels


def reference_gradients(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every document alone through the model (its own positions and attention); loss = sum / label count."""
    model.zero_grad(set_to_none=True)
    num_labels = int(DOC_LENS.sum() - DOC_LENS.size)
    start = 0
    for length in DOC_LENS:
        doc = tokens[start:start + length]
        logits = model(input_ids=doc[None], use_cache=False).logits[0]
        (causal_lm_loss_sum(logits, document_labels(doc)) / num_labels).backward()
        start += length
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in model.named_parameters()}


def cp_gradients(model, tokens: torch.Tensor, rank: int, group=None) -> dict[str, torch.Tensor]:
    """One CP forward and backward of this rank's shards; gradients summed over the ranks."""
    model.zero_grad(set_to_none=True)
    meta = CPAttnMeta.from_plan(PLAN, DOC_LENS, rank)
    global_pos, position, doc = rank_token_positions(PLAN, DOC_LENS, rank)
    global_pos, position = torch.from_numpy(global_pos), torch.from_numpy(position)
    is_last = position + 1 == torch.from_numpy(DOC_LENS[doc])
    labels = torch.where(is_last, IGNORE_INDEX, tokens[torch.clamp(global_pos + 1, max=tokens.numel() - 1)])
    recurrent = RecurrentMeta.from_plan(PLAN, DOC_LENS, rank) if uses_cp_recurrent(model) else None
    logits = model(input_ids=tokens[global_pos][None], position_ids=position[None], use_cache=False,
                   **hf_attention_kwargs(meta, group=group, comm="a2a", recurrent=recurrent)).logits[0]
    num_labels = int(DOC_LENS.sum() - DOC_LENS.size)
    (causal_lm_loss_sum(logits, labels) / num_labels).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest |got - want| of a parameter relative to that parameter's largest |want|, and which parameter."""
    worst, where = 0.0, ""
    for name, w in want.items():
        scale = w.abs().max().item()
        if scale == 0:
            continue
        err = (got[name] - w).abs().max().item() / scale
        if err > worst:
            worst, where = err, name
    return worst, where


def cp_step_error(model_type: str, class_name: str, rank: int, group=None, *, run_recurrent: bool = True,
                  **overrides) -> tuple[float, str]:
    """One CP step of the tiny architecture against one process (module docstring).

    ``run_recurrent=False`` leaves a hybrid's recurrent mixers to transformers' own forward (what the refusal
    prevents).
    """
    model = tiny_model(model_type, class_name, **overrides)
    tokens = sequence_tokens(model.config.get_text_config().vocab_size)
    want = reference_gradients(model, tokens)
    register_flashcp_attention()
    model.set_attn_implementation("cp_attention")
    if run_recurrent:
        apply_cp_recurrent(model)  # a hybrid's recurrent mixers, as hf_loss_sum and CPTrainer run them
    got = cp_gradients(model, tokens, rank, group)
    return relative_error(got, want)
