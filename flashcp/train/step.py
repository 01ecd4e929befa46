"""One optimizer step of CP training (optionally data parallel x CP), and what it measured.

Every rank of the CP group runs ``train_step`` on its own part of the same sequence (a ``Batch`` from
``CPLoader``). The loss a rank back-propagates is its *local* sum of token losses divided by the label count
of the whole global batch: the sequence's ``batch.num_label_tokens`` (known from the plan), summed over the
data-parallel replicas when there are several (one scalar all-reduce). The ranks' losses then add up to the
global batch's mean loss, and summing the gradients over every rank that trains the model (the CP group, or
the flattened dp x cp mesh) gives exactly the gradient a single process computes on the whole global batch.
Replicated parameters are summed by one all-reduce of a flat buffer per dtype; an FSDP2-sharded model
(``flashcp.train.parallel``) reduce-scatters in backward. Every rank then takes the same optimizer step.
The loss is computed in float32 or wider whatever the model's dtype.

Shape legend: ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads, ``D`` head dim, ``V``
vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashcp.errors import FlashcpError
from flashcp.models.tiny import causal_lm_loss_sum
from flashcp.runtime import CommStats, CPAttnMeta, cp_attention
from flashcp.runtime.loader import IGNORE_INDEX, Batch
from flashcp.train.parallel import ParallelGroups, is_sharded

__all__ = ["CPAttention", "LossSumFn", "StepResult", "agree_on_errors", "all_reduce_gradients", "fold_vocab",
           "group_rank", "group_size", "tiny_loss_sum", "train_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CPAttention:
    """``cp_attention`` bound to one batch's meta: ``attn(q_THD, k_TKD, v_TKD) -> out_THD``."""

    meta: CPAttnMeta
    """This rank's meta for the sequence (``batch.attn``)."""
    group: Any = None
    """The CP process group (None: the default group)."""
    comm: str = "auto"
    """``allgather``, ``a2a``, ``full`` or ``auto``."""
    backend: str = "auto"
    """``flash_attn``, ``torch_varlen``, ``reference`` or ``auto``."""
    stats: CommStats | None = None
    """Records every collective issued, or None."""

    def __call__(self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                 softmax_scale: float | None = None) -> torch.Tensor:
        """Attention of this rank's queries (T, H, D) over keys/values (T, K, D); returns (T, H, D)."""
        return cp_attention(q_THD, k_TKD, v_TKD, self.meta, group=self.group, comm=self.comm,
                            backend=self.backend, stats=self.stats, softmax_scale=softmax_scale)


LossSumFn = Callable[[nn.Module, Batch, CPAttention], torch.Tensor]
"""``loss_sum(model, batch, attn)``: the model's summed next-token loss over this rank's labels (a scalar)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one ``train_step`` did on this rank."""

    loss: float
    """The sequence's mean next-token loss over all its labels (all ranks together), before the update."""
    num_label_tokens: int
    """Labels the loss averages over (all ranks)."""
    seconds: float
    """Wall time on this rank: forward, backward, gradient all-reduce and optimizer update."""
    kv_sent_bytes: int
    """K/V (forward) plus dK/dV (backward) bytes this rank sent, all layers."""
    kv_recv_bytes: int
    """K/V plus dK/dV bytes that reached this rank, all layers."""
    grad_bytes: int
    """Bytes of this rank's input to the gradient reduction (all-reduce of all replicated parameters, or the
    reduce-scatters of a sharded model: its unsharded gradients)."""


def group_size(group=None) -> int:
    """Ranks in ``group``; 1 when no process group is initialised (a single-process run)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def group_rank(group=None) -> int:
    """The rank of this process in ``group``; 0 when no process group is initialised."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def agree_on_errors(error: Exception | None, group=None) -> None:
    """Collective: every rank raises the lowest failing rank's FlashcpError, or none does."""
    message = None if error is None else str(error)
    if group_size(group) > 1:
        messages: list[str | None] = [None] * group_size(group)
        dist.all_gather_object(messages, message, group=group)
        message = next((m for m in messages if m is not None), None)
    if message is not None:
        raise FlashcpError(message)


def fold_vocab(batch: Batch, vocab_size: int) -> Batch:
    """The batch with token ids and labels taken modulo ``vocab_size`` (labels of -100 kept).

    For models whose vocabulary is smaller than the tokenizer's (the tiny demo models); identity when every
    id is already below ``vocab_size``.
    """
    labels = batch.labels
    return replace(batch, input_ids=batch.input_ids % vocab_size,
                   labels=torch.where(labels == IGNORE_INDEX, labels, labels % vocab_size))


def tiny_loss_sum(model: nn.Module, batch: Batch, attn: CPAttention) -> torch.Tensor:
    """Summed loss of a ``TinyDecoder`` (``flashcp.models.tiny``) over this rank's labels."""
    logits_TV = model(batch.input_ids, batch.position_ids, attn)
    return causal_lm_loss_sum(logits_TV, batch.labels)


def all_reduce_gradients(params: Iterable[nn.Parameter], group=None,
                         extra: torch.Tensor | None = None) -> tuple[float | None, int]:
    """Sum the gradients of ``params`` over ``group`` in place: one flat all-reduce per (dtype, device).

    A parameter without a gradient on this rank counts as zeros (and receives the others' sum), so every rank
    issues the same collectives. ``extra``, a scalar, is summed alongside in float64 (the step's loss): in
    the float64 gradient buffer when there is one, else in a one-element buffer of its own.
    Returns ``(extra summed or None, bytes of this rank's gradient input)``.
    """
    buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    flats = [torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
             for bucket in buckets.values()]
    grad_bytes = sum(f.numel() * f.element_size() for f in flats)
    extra_at = None  # (buffer index) holding ``extra`` as its last element
    if extra is not None:
        extra_at = next((i for i, f in enumerate(flats) if f.dtype == torch.float64), len(flats))
        scalar = extra.detach().reshape(1).to(torch.float64)
        if extra_at == len(flats):
            flats.append(scalar)
        else:
            flats[extra_at] = torch.cat((flats[extra_at], scalar.to(flats[extra_at].device)))
    if group_size(group) > 1:
        for flat in flats:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    extra_sum = None
    if extra_at is not None:
        extra_sum = float(flats[extra_at][-1])
        flats[extra_at] = flats[extra_at][:-1]
    for bucket, flat in zip(buckets.values(), flats):
        offset = 0
        for p in bucket:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return extra_sum, grad_bytes


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
               loss_sum_fn: LossSumFn = tiny_loss_sum, *, group=None, comm: str = "auto",
               backend: str = "auto", groups: ParallelGroups | None = None) -> StepResult:
    """Forward, backward, gradient reduction and one optimizer step, on every rank.

    Args:
        model: the model: replicated (same weights on every rank) or FSDP2-sharded over ``groups``.
        optimizer: its optimizer.
        batch: this rank's view of its replica's sequence (on the model's device).
        loss_sum_fn: the model's summed loss over this rank's labels, given a CPAttention to attend with.
        group: the CP process group whose ranks are the plan's ranks (None: the default group); used when
            ``groups`` is None (CP only, no data parallelism).
        comm: the K/V exchange (``allgather``, ``a2a``, ``full``, ``auto``).
        backend: the attention kernel backend.
        groups: data parallel x CP groups (``ParallelGroups.from_mesh``), or None.

    Raises ValueError when the CP group's size is not the plan's ``cp``.
    """
    cp_group, dp_group, grad_group = group, None, group
    if groups is not None:
        cp_group, dp_group, grad_group = groups.cp_group, groups.dp_group, groups.grad_group
    world = group_size(cp_group)
    if world != batch.attn.cp:
        raise ValueError(f"the batch is planned for cp {batch.attn.cp} but the CP group has {world} ranks")
    device = batch.input_ids.device
    start = time.perf_counter()
    num_label_tokens = batch.num_label_tokens
    if dp_group is not None and group_size(dp_group) > 1:
        count = torch.tensor([num_label_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, group=dp_group)
        num_label_tokens = int(count.item())
    optimizer.zero_grad(set_to_none=True)
    stats = CommStats()
    attn = CPAttention(meta=batch.attn, group=cp_group, comm=comm, backend=backend, stats=stats)
    loss = loss_sum_fn(model, batch, attn) / max(num_label_tokens, 1)
    loss.backward()
    if is_sharded(model):  # FSDP2 reduce-scattered the gradients in backward; sum the loss for the log
        total = loss.detach().to(torch.float64).reshape(1)
        if group_size(grad_group) > 1:
            dist.all_reduce(total, group=grad_group)
        total_loss: float | None = float(total.item())
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    else:
        total_loss, grad_bytes = all_reduce_gradients(model.parameters(), grad_group, extra=loss)
    optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert total_loss is not None
    return StepResult(loss=total_loss, num_label_tokens=num_label_tokens,
                      seconds=time.perf_counter() - start, kv_sent_bytes=stats.total("sent_bytes"),
                      kv_recv_bytes=stats.total("recv_bytes"), grad_bytes=grad_bytes)
