"""The training loss: summed next-token cross-entropy over this rank's labels, and the hook ``train_step`` calls.

Under CP every rank returns its *local* sum; ``train_step`` divides it by the label count of the whole global
batch (known from the plan), so the ranks' losses add up to the single-process mean loss and their summed
gradients to its gradient. A model family brings its own ``LossSumFn`` (``tiny_loss_sum`` here; transformers'
and torchtitan's in ``flashcp.integrations``), each ending in ``causal_lm_loss_sum`` or an equal sum.

Shape legend: ``T`` this rank's tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flashcp.runtime.loader import IGNORE_INDEX, Batch
from flashcp.runtime.module import CPAttention

__all__ = ["LossSumFn", "causal_lm_loss_sum", "tiny_loss_sum"]

LossSumFn = Callable[[nn.Module, Batch, CPAttention], torch.Tensor]
"""``loss_sum(model, batch, attn)``: the model's summed next-token loss over this rank's labels (a scalar)."""


def causal_lm_loss_sum(logits_TV: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over labels != -100.

    Under CP every rank returns its local sum; dividing by the sequence's total label count (known from the
    plan) and all-reducing gradients gives exactly the single-process mean loss and its gradient. Computed
    in float32 or wider whatever the logits' dtype (a bf16 softmax over the vocabulary and a bf16 sum over
    thousands of tokens are each off by about 0.1%); the result is float32 or float64.
    """
    wide = torch.promote_types(logits_TV.dtype, torch.float32)
    return F.cross_entropy(logits_TV.to(wide), labels_T, ignore_index=IGNORE_INDEX, reduction="sum")


def tiny_loss_sum(model: nn.Module, batch: Batch, attn: CPAttention) -> torch.Tensor:
    """Summed loss of a ``TinyDecoder`` (``flashcp.models.tiny``) over this rank's labels."""
    logits_TV = model(batch.input_ids, batch.position_ids, attn)
    return causal_lm_loss_sum(logits_TV, batch.labels)
