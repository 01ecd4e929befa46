"""Training with CP: the step (forward, backward, gradient all-reduce, update), checkpoints and the loop."""

from flashcp.train.checkpoint import load_checkpoint, save_checkpoint
from flashcp.train.step import CPAttention, StepResult, all_reduce_gradients, fold_vocab, train_step

__all__ = ["CPAttention", "StepResult", "all_reduce_gradients", "fold_vocab", "load_checkpoint",
           "save_checkpoint", "train_step"]
