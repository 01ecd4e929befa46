"""The models flashcp's training loop builds by name (``examples/train_tiny.py --model``).

``build_model`` is the ``ModelBuilder`` a caller hands to ``flashcp.train.loop.run_training``: ``tiny``
(``flashcp.models.tiny``, built by the loop's own ``build_tiny_model``), the transformers architectures of
``flashcp.integrations.hf`` and the torchtitan decoders of ``flashcp.integrations.torchtitan``, each with its
loss hook and, for torchtitan, its own FSDP2 wrapping. transformers and torchtitan are imported only when
their model is built (optional dependencies).
"""

from __future__ import annotations

from typing import Any

import torch

from flashcp.train.loop import DTYPES, TrainModel, TrainOptions, build_tiny_model, default_dtype

__all__ = ["MODELS", "build_model"]

MODELS = ("tiny", "llama", "qwen2", "titan-llama3", "titan-qwen3")
"""``tiny``, transformers architectures (``HF_ARCHITECTURES``), and torchtitan decoders (``titan-`` and one of
``TITAN_ARCHITECTURES``)."""


def build_model(options: TrainOptions, device: torch.device, context_len: int | None = None) -> TrainModel:
    """The model ``options.model`` names on ``device`` (weights from torch's RNG), its loss hook and sharding.

    The shape comes from ``options`` (FFN width ``2 * dim``); ``context_len`` sizes a torchtitan model's RoPE
    cache (None: its flavor's). Raises ValueError for a name not in ``MODELS``.
    """
    if options.model not in MODELS:
        raise ValueError(f"unknown model '{options.model}' (choose from {', '.join(MODELS)})")
    if options.model == "tiny":
        return build_tiny_model(options, device, context_len)
    dtype = DTYPES[options.dtype or default_dtype(device)]
    shape: dict[str, Any] = dict(vocab_size=options.vocab_size, dim=options.dim,
                                 num_layers=options.num_layers, num_heads=options.num_heads,
                                 num_kv_heads=options.num_kv_heads)
    if options.model.startswith("titan-"):
        from flashcp.integrations.torchtitan import (
            build_titan_model,
            shard_titan_model,
            titan_loss_sum,
            titan_model_config,
        )

        config = titan_model_config(options.model.removeprefix("titan-"), **shape, ffn_dim=2 * options.dim,
                                    max_seq_len=context_len)
        return TrainModel(model=build_titan_model(config, device=device, dtype=dtype), loss_sum_fn=titan_loss_sum,
                          fsdp=shard_titan_model)
    from flashcp.integrations.hf import hf_loss_sum, tiny_hf_model
    from flashcp.integrations.hf_support import check_hf_model

    model = tiny_hf_model(options.model, **shape, ffn_dim=2 * options.dim, dtype=dtype).to(device)
    check_hf_model(model)
    return TrainModel(model=model, loss_sum_fn=hf_loss_sum)
