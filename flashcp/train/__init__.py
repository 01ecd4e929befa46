"""Training with CP: the loss, the step (forward, backward, gradient all-reduce, update), checkpoints and the loop.

``CPAttention`` lives in ``flashcp.runtime`` and is importable from here too.
"""

from flashcp.runtime.module import CPAttention
from flashcp.train.checkpoint import load_checkpoint, save_checkpoint
from flashcp.train.loss import LossSumFn, causal_lm_loss_sum, tiny_loss_sum
from flashcp.train.step import StepResult, all_reduce_gradients, fold_vocab, train_step

__all__ = ["CPAttention", "LossSumFn", "StepResult", "all_reduce_gradients", "causal_lm_loss_sum", "fold_vocab",
           "load_checkpoint", "save_checkpoint", "tiny_loss_sum", "train_step"]
