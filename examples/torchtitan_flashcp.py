"""A torchtitan config with flashcp CP switched on: copy it, change the numbers, name it with ``--module``.

torchtitan 0.3 configures a run with a Python function returning a ``Trainer.Config`` (its ``config_registry``;
there are no TOML job files in 0.3). This file is such a registry; from the repository root::

    flashcp synth DATA --dist wlb --num-seqs 64 --context-len 131072 && flashcp plan DATA --cp 8
    torchrun --nproc-per-node 8 -m torchtitan.train --module examples.torchtitan_flashcp \
        --config llama3_8b_128k --dataloader.data_dir DATA

Every field can still be set on the command line (``--training.steps 100``, ``--flashcp.comm a2a``,
``--parallelism.data_parallel_shard_degree 2`` with 16 ranks, ...). ``tiny`` is the GPU script's run
(``scripts/gpu_check.sh``): torchtitan's Llama3 ``debugmodel``, 2048-token sequences, CP over every GPU.
"""

from __future__ import annotations

import dataclasses

from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel

from flashcp.integrations.torchtitan_trainer import FlashcpOptions, FlashcpTrainer, flashcp_trainer_config


def llama3_8b_128k() -> FlashcpTrainer.Config:
    """Llama3-8B on 131,072-token packed sequences, CP 8 with the ``cp8-flashcp2`` plan."""
    config = flashcp_trainer_config(llama3_8b(), plan="cp8-flashcp2", options=FlashcpOptions(comm="auto"))
    config.parallelism = dataclasses.replace(config.parallelism, context_parallel_degree=8)
    config.training = dataclasses.replace(config.training, seq_len=131072, steps=1000)
    for layer in config.model_spec.model.layers:  # RoPE's cache covers the context; positions are per document
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=131072)
    return config


def tiny() -> FlashcpTrainer.Config:
    """torchtitan's Llama3 ``debugmodel`` (vocabulary 2048) on 2048-token sequences, 4 steps, no checkpoints."""
    config = flashcp_trainer_config(llama3_debugmodel(), plan="cp1-flashcp2")
    config.training = dataclasses.replace(config.training, seq_len=2048, steps=4)
    config.checkpoint = dataclasses.replace(config.checkpoint, enable=False)
    return config
