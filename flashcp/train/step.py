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

Gradient accumulation: ``train_step`` takes a list of micro-batches (this replica's sequences of the step, in
order). The global batch is every replica's micro-batches; each micro-batch's loss sum is divided by the label
count of that whole global batch (known before the first backward, summed over the replicas), the backward
passes accumulate, and one reduction and one optimizer step follow: the update of one process on the global
batch. Gradient clipping (``max_grad_norm``) scales the reduced gradients so that their global L2 norm is at
most the limit (``torch.nn.utils.clip_grads_with_norm_``; a sharded model's norm covers every shard).

Host syncs: none before the optimizer step. The data-parallel label count stays on the device (the loss is
divided by it there), the loss and the K/V byte counts of every rank ride in the gradient all-reduce (a
float64 tail of the flat buffer: the loss, then one ``(sent, received)`` slot per rank, so the sum gathers
them), and a single small device-to-host read after ``optimizer.step()`` brings back the loss, the label
count and the gathered bytes. On CUDA the step is timed with CUDA events, complete by the time of that read.
Replicated gradients live in persistent flat buffers (one per dtype and device, kept for the model): every
parameter's ``.grad`` is a view into them, zeroed before the backward, so autograd accumulates in place and
the all-reduce needs no copy.

Shape legend: ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads, ``D`` head dim, ``V``
vocabulary.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from flashcp.errors import FlashcpError
from flashcp.runtime import CommStats, CPAttention
from flashcp.runtime.loader import IGNORE_INDEX, Batch
from flashcp.train.loss import LossSumFn, tiny_loss_sum
from flashcp.train.parallel import ParallelGroups, is_sharded

__all__ = ["StepResult", "agree_on_errors", "all_reduce_gradients", "clip_gradients", "fold_vocab", "group_rank",
           "group_size", "train_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What one ``train_step`` did on this rank."""

    loss: float
    """The sequence's mean next-token loss over all its labels (all ranks together), before the update."""
    num_label_tokens: int
    """Labels the loss averages over (all ranks)."""
    seconds: float
    """Time of the step on this rank: forward, backward, gradient all-reduce and optimizer update (CUDA
    events on a GPU, wall time otherwise)."""
    kv_sent_bytes: int
    """K/V (forward) plus dK/dV (backward) bytes this rank sent, all layers."""
    kv_recv_bytes: int
    """K/V plus dK/dV bytes that reached this rank, all layers."""
    kv_bytes_busiest: int
    """Largest sent plus received K/V bytes of one rank, over the ranks that train the model together."""
    kv_bytes_total: int
    """K/V bytes sent, summed over those ranks."""
    grad_bytes: int
    """Bytes of this rank's input to the gradient reduction (all-reduce of all replicated parameters, or the
    reduce-scatters of a sharded model: its unsharded gradients)."""
    grad_norm: float | None = None
    """Global L2 norm of the gradients before clipping; None when the step did not clip."""


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


class GradientBuffers:
    """Flat gradient buffers of some parameters, one per (dtype, device); every ``.grad`` a view into them.

    ``num_extra`` float64 values follow the gradients (in the float64 buffer when there is one, else in a
    buffer of their own): ``all_reduce`` sums them alongside. Kept across steps (``for_model``).
    """

    def __init__(self, params: Iterable[nn.Parameter], num_extra: int = 0):
        self.params = [p for p in params if p.requires_grad]
        self.num_extra = num_extra
        buckets: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in self.params:
            buckets.setdefault((p.dtype, p.device), []).append(p)
        self.buckets = list(buckets.items())
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.extra_at = next((i for i, ((dtype, _), _) in enumerate(self.buckets) if dtype == torch.float64),
                             len(self.buckets))
        self.flats = []
        for i, ((dtype, device), bucket) in enumerate(self.buckets):
            size = sum(p.numel() for p in bucket) + (num_extra if i == self.extra_at else 0)
            self.flats.append(torch.zeros(size, dtype=dtype, device=device))
        if self.extra_at == len(self.buckets) and num_extra:
            device = self.params[0].device if self.params else torch.device("cpu")
            self.flats.append(torch.zeros(num_extra, dtype=torch.float64, device=device))
        self.views = [flat[offset:offset + p.numel()].view_as(p) for flat, bucket in zip(self.flats, self._groups())
                      for p, offset in bucket]

    def _groups(self):
        for _, bucket in self.buckets:
            offsets = [0]
            for p in bucket[:-1]:
                offsets.append(offsets[-1] + p.numel())
            yield list(zip(bucket, offsets))

    @staticmethod
    def for_model(model: nn.Module, num_extra: int) -> GradientBuffers:
        """The buffers kept for ``model`` (made again when its parameters or ``num_extra`` changed)."""
        buffers = _MODEL_BUFFERS.get(model)
        params = [p for p in model.parameters() if p.requires_grad]
        if buffers is None or buffers.num_extra != num_extra or len(buffers.params) != len(params) or any(
                a is not b for a, b in zip(buffers.params, params)):
            buffers = GradientBuffers(params, num_extra)
            _MODEL_BUFFERS[model] = buffers
        return buffers

    @property
    def extra(self) -> torch.Tensor:
        """The ``num_extra`` float64 values after the gradients (a view)."""
        return self.flats[self.extra_at][-self.num_extra:] if self.num_extra else self.flats[0][:0]

    def attach(self) -> None:
        """Zero the buffers and make every parameter's ``.grad`` its view (before the backward pass)."""
        for flat in self.flats:
            flat.zero_()
        for p, view in zip(self.params, self.views):
            p.grad = view

    def gather(self) -> None:
        """Copy into the buffers every ``.grad`` that is not its view (None counts as zeros); then attach."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    def all_reduce(self, group=None) -> None:
        """Sum the buffers (gradients and extra values) over ``group``, in place: one all-reduce per buffer."""
        if group_size(group) > 1:
            for flat in self.flats:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)


_MODEL_BUFFERS: weakref.WeakKeyDictionary[nn.Module, GradientBuffers] = weakref.WeakKeyDictionary()


def all_reduce_gradients(params: Iterable[nn.Parameter], group=None,
                         extra: torch.Tensor | None = None) -> tuple[float | None, int]:
    """Sum the gradients of ``params`` over ``group`` in place: one flat all-reduce per (dtype, device).

    A parameter without a gradient on this rank counts as zeros (and receives the others' sum), so every rank
    issues the same collectives. ``extra``, a scalar, is summed alongside in float64 (the step's loss): in
    the float64 gradient buffer when there is one, else in a one-element buffer of its own; reading it back
    is a host sync (``train_step`` uses ``GradientBuffers`` and reads once, after the optimizer step).
    Returns ``(extra summed or None, bytes of this rank's gradient input)``.
    """
    buffers = GradientBuffers(params, num_extra=0 if extra is None else 1)
    buffers.gather()
    if extra is not None:
        buffers.extra.copy_(extra.detach().reshape(1))
    buffers.all_reduce(group)
    return (None if extra is None else float(buffers.extra[0])), buffers.grad_bytes


class _StepTimer:
    """CUDA events on a GPU (read after the step's one host read, so they are complete), else wall time."""

    def __init__(self, device: torch.device):
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.end = time.perf_counter(), 0.0

    def stop(self) -> None:
        if self.events is not None:
            self.events[1].record()
        self.end = time.perf_counter()

    def seconds(self) -> float:
        if self.events is not None:
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.end - self.start


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch | Sequence[Batch],
               loss_sum_fn: LossSumFn = tiny_loss_sum, *, group=None, comm: str = "auto",
               backend: str = "auto", groups: ParallelGroups | None = None,
               max_grad_norm: float | None = None) -> StepResult:
    """Forward, backward, gradient reduction and one optimizer step, on every rank.

    Args:
        model: the model: replicated (same weights on every rank) or FSDP2-sharded over ``groups``.
        optimizer: its optimizer.
        batch: this rank's view of its replica's sequence (on the model's device), or of each of its
            micro-batches (gradient accumulation; every replica the same number).
        loss_sum_fn: the model's summed loss over this rank's labels, given a CPAttention to attend with.
        group: the CP process group whose ranks are the plan's ranks (None: the default group); used when
            ``groups`` is None (CP only, no data parallelism).
        comm: the K/V exchange (``allgather``, ``a2a``, ``full``, ``auto``).
        backend: the attention kernel backend.
        groups: data parallel x CP groups (``ParallelGroups.from_mesh``), or None.
        max_grad_norm: clip the reduced gradients to this global L2 norm; None: no clipping.

    One host sync, after the optimizer step (see the module docstring). Raises ValueError when the CP
    group's size is not the plan's ``cp``, for no micro-batch, or for a ``max_grad_norm`` that is not positive.
    """
    batches = [batch] if isinstance(batch, Batch) else list(batch)
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be positive (or None: no clipping), got {max_grad_norm}")
    cp_group, dp_group, grad_group = group, None, group
    if groups is not None:
        cp_group, dp_group, grad_group = groups.cp_group, groups.dp_group, groups.grad_group
    world = group_size(cp_group)
    for one in batches:
        if world != one.attn.cp:
            raise ValueError(f"the batch is planned for cp {one.attn.cp} but the CP group has {world} ranks")
    device = batches[0].input_ids.device
    timer = _StepTimer(device)
    count: torch.Tensor | None = None
    labels = sum(one.num_label_tokens for one in batches)
    denominator: torch.Tensor | int = max(labels, 1)
    if dp_group is not None and group_size(dp_group) > 1:  # the replicas' label counts, summed on the device
        count = torch.full((1,), labels, dtype=torch.int64, device=device)  # no copy
        dist.all_reduce(count, group=dp_group)
        denominator = count.clamp_min(1)
    ranks, rank = group_size(grad_group), group_rank(grad_group)
    sharded = is_sharded(model)
    buffers = None
    if sharded:
        optimizer.zero_grad(set_to_none=True)
    else:
        buffers = GradientBuffers.for_model(model, num_extra=1 + 2 * ranks)
        buffers.attach()
    stats = CommStats()
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, one in enumerate(batches):
        if sharded and len(batches) > 1 and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(i == len(batches) - 1)  # type: ignore[operator]  # FSDP2 adds it
        attn = CPAttention(meta=one.attn, group=cp_group, comm=comm, backend=backend, stats=stats)
        micro_loss = loss_sum_fn(model, one, attn) / denominator
        micro_loss.backward()
        loss = loss + micro_loss.detach()
    sent, received = stats.total("sent_bytes"), stats.total("recv_bytes")
    if buffers is None:  # FSDP2 reduce-scattered the gradients in backward; sum the loss and bytes alone
        extra = torch.zeros(1 + 2 * ranks, dtype=torch.float64, device=device)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    else:
        buffers.gather()
        extra, grad_bytes = buffers.extra, buffers.grad_bytes
    extra[0] = loss.detach().reshape(())
    extra[1 + 2 * rank], extra[2 + 2 * rank] = float(sent), float(received)  # fills: no host-to-device copy
    if buffers is None:
        if ranks > 1:
            dist.all_reduce(extra, group=grad_group)
    else:
        buffers.all_reduce(grad_group)
    norm = None if max_grad_norm is None else clip_gradients(model.parameters(), max_grad_norm)
    optimizer.step()
    timer.stop()
    # the step's one host read: loss, label count, every rank's K/V bytes and the gradient norm
    tail = [t.reshape(1).to(extra.dtype) for t in (count, norm) if t is not None]
    values = torch.cat((extra, *tail)).tolist()
    slots = values[1:1 + 2 * ranks]
    return StepResult(loss=values[0], num_label_tokens=int(values[1 + 2 * ranks]) if count is not None
                      else labels, seconds=timer.seconds(), kv_sent_bytes=sent,
                      kv_recv_bytes=received, kv_bytes_busiest=int(max(a + b for a, b in zip(slots[::2], slots[1::2]))),
                      kv_bytes_total=int(sum(slots[::2])), grad_bytes=grad_bytes,
                      grad_norm=None if norm is None else values[-1])


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``params`` so that their global L2 norm is at most ``max_norm``, in place.

    Returns the norm before clipping, a 0-d tensor on the gradients' device (no host sync). Gradients of a
    sharded model (DTensors) count every shard: the norm is the whole model's on every rank.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
