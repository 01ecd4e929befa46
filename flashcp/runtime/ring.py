"""The ``ring`` comm mode: K/V blocks travel around the CP ranks point-to-point (the Ring-Attn baselines).

Each rank's block is its whole K/V, ``(2, T_r, K, D)`` (K in ``[0]``, V in ``[1]``), in local layout order:
a step's keys, when they are one run of rows (every step of the ``ring`` layout), are then a contiguous slice
and nothing is copied for the kernel. At step ``s = 0 .. N-1`` rank ``r`` holds the block of rank
``(r - s) mod N`` and computes one varlen kernel call over it (``RingStep`` in ``flashcp.runtime.meta``);
meanwhile the block moves on to rank ``r + 1`` and the next one arrives from ``r - 1`` (``N - 1`` transfers,
each overlapping one step's compute).
Each step returns partial outputs and their log-sum-exps, merged in ``lse_dtype`` (float32 or wider):

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which equals attention over the union of the keys. With the ``ring`` plan layout this is Ring-Attn; with
the ``perdoc`` layout it is Ring-Attn (zigzag) (ring-flash-attention's varlen ring and zigzag ring).

Backward (ring-flash-attention's scheme): the K/V blocks go round once more; at every step the kernel's
backward, fed the *merged* output and log-sum-exp, gives this step's share of dq (added locally) and of the
visiting block's dK/dV. That share is added to a float32-or-wider dK/dV buffer that travels with the block:
it starts at the first rank the block visits (step 1), picks up every visited rank's share and, after
``N - 1`` hops, arrives back at the owner, who adds its own step-0 share. So the backward moves ``N - 1``
K/V blocks and ``N - 1`` dK/dV blocks per rank, each transfer overlapping one step's compute.

Every transfer is a ``batch_isend_irecv`` on the given group (K/V and dK/dV use different tags); empty
blocks are not sent. Shape legend: ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads,
``D`` head dim, ``R`` rows of a block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from flashcp.runtime.comm import CommRecord, CommStats
from flashcp.runtime.kernels import lse_dtype, varlen_attention_backward, varlen_attention_forward
from flashcp.runtime.meta import RingSchedule, RingStep

__all__ = ["merge_partial", "ring_attention", "ring_attention_from_blocks"]

_KV_TAG, _DKV_TAG = 17, 18


def merge_partial(out_TAHD: torch.Tensor, lse_TH: torch.Tensor, index: torch.Tensor, block_out: torch.Tensor,
                  block_lse: torch.Tensor) -> None:
    """Merge a partial attention result into the running one, in place, for the queries ``index``.

    Args:
        out_TAHD: running outputs, (T, H, D), in ``lse_dtype``; rows ``index`` are updated.
        lse_TH: running log-sum-exps, (T, H), same dtype; ``-inf`` where nothing was merged yet.
        index: (n,) int64 query rows, no repeats.
        block_out: the block's outputs for these queries, (n, H, D), any float dtype.
        block_lse: the block's log-sum-exps, (n, H), finite.

    Both weights ``exp(lse_x - new_lse)`` are at most 1, so nothing overflows.
    """
    acc = out_TAHD.dtype
    old_lse, new_part = lse_TH.index_select(0, index), block_lse.to(acc)
    new_lse = torch.logaddexp(old_lse, new_part)
    merged = (out_TAHD.index_select(0, index) * torch.exp(old_lse - new_lse).unsqueeze(-1)
              + block_out.to(acc) * torch.exp(new_part - new_lse).unsqueeze(-1))
    out_TAHD.index_copy_(0, index, merged)
    lse_TH.index_copy_(0, index, new_lse)


def _rows(x: torch.Tensor, index: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    """``x[index]`` along dim 0: a slice (no copy) when ``index`` is the range ``rows``."""
    return x[rows[0]:rows[1]] if rows is not None else x.index_select(0, index)


def _block_kv(block_2RKD: torch.Tensor, step: RingStep) -> tuple[torch.Tensor, torch.Tensor]:
    k_SKD = _rows(block_2RKD[0], step.kv_index, step.kv_range)
    return k_SKD, _rows(block_2RKD[1], step.kv_index, step.kv_range)


def _forward_steps(q_THD: torch.Tensor, ring: RingSchedule, blocks: Iterable[torch.Tensor],
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_THD in q's dtype, lse_TH in lse_dtype)`` over every step's block (``blocks`` in step order)."""
    acc = lse_dtype(q_THD.dtype)
    out = q_THD.new_zeros(q_THD.shape, dtype=acc)
    lse = q_THD.new_full(q_THD.shape[:2], float("-inf"), dtype=acc)
    for step, block in zip(ring.steps, blocks):
        part = step.part
        if part.num_tokens == 0:
            continue
        k, v = _block_kv(block, step)
        block_out, block_lse = varlen_attention_forward(
            _rows(q_THD, part.q_index, step.q_range), k, v, part.cu_seqlens_q, part.cu_seqlens_k,
            part.max_seqlen_q, part.max_seqlen_k, step.causal, backend)
        if step.causal:  # step 0 comes first and covers every query: nothing to merge with yet
            out.index_copy_(0, part.q_index, block_out.to(acc))
            lse.index_copy_(0, part.q_index, block_lse.to(acc))
        else:
            merge_partial(out, lse, part.q_index, block_out, block_lse)
    return out.to(q_THD.dtype), lse


def _backward_steps(grad_out_THD: torch.Tensor, q_THD: torch.Tensor, out_THD: torch.Tensor,
                    lse_TH: torch.Tensor, ring: RingSchedule, blocks: Iterable[torch.Tensor], backend: str,
                    take_grad: Callable[[int, RingStep, torch.Tensor], None]) -> torch.Tensor:
    """Return dq (q's dtype); hand each step's block gradient, (2, R, K, D) in lse_dtype, to ``take_grad``."""
    acc = lse_dtype(q_THD.dtype)
    dq = q_THD.new_zeros(q_THD.shape, dtype=acc)
    grad_out_THD = grad_out_THD.contiguous()
    for index, (step, block) in enumerate(zip(ring.steps, blocks)):
        part = step.part
        grad_block = block.new_zeros(block.shape, dtype=acc)
        if part.num_tokens:
            k, v = _block_kv(block, step)
            dout, q, out, lse = (_rows(x, part.q_index, step.q_range)
                                 for x in (grad_out_THD, q_THD, out_THD, lse_TH))
            dq_part, dk, dv = varlen_attention_backward(
                dout, q, k, v, out, lse, part.cu_seqlens_q, part.cu_seqlens_k, part.max_seqlen_q,
                part.max_seqlen_k, step.causal, backend)
            dq.index_add_(0, part.q_index, dq_part.to(acc))
            grad_block.index_add_(1, step.kv_index, torch.stack((dk, dv)).to(acc))
        take_grad(index, step, grad_block)
    return dq.to(q_THD.dtype)


class _PendingP2P:
    """One step's send to the next rank and receive from the previous one, in flight."""

    __slots__ = ("requests", "send", "recv")

    def __init__(self, requests, send: torch.Tensor, recv: torch.Tensor):
        self.requests, self.recv = requests, recv
        self.send: torch.Tensor | None = send  # kept alive until the send is done

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        self.send = None
        return self.recv


class _RingP2P:
    """Point-to-point ring transfers of one ``cp_attention`` call on an explicit process group."""

    def __init__(self, ring: RingSchedule, group, stats: CommStats | None):
        self.ring, self.group, self.stats = ring, group, stats
        self.rank, self.cp = ring.rank, len(ring.steps)

        def global_rank(r):
            return dist.get_global_rank(group, r) if group is not None else r

        self.next_peer = global_rank((self.rank + 1) % self.cp)
        self.prev_peer = global_rank((self.rank - 1) % self.cp)

    def start(self, send: torch.Tensor, recv_rows: int, tag: int, direction: str, tensor: str) -> _PendingP2P:
        """Send ``send`` to the next rank, receive ``recv_rows`` rows from the previous one; asynchronous."""
        send = send.contiguous()
        recv = send.new_empty((2, recv_rows, *send.shape[2:]))
        rows_out = int(send.shape[1])
        ops = []
        if rows_out:
            ops.append(dist.P2POp(dist.isend, send, self.next_peer, group=self.group, tag=tag))
        if recv_rows:
            ops.append(dist.P2POp(dist.irecv, recv, self.prev_peer, group=self.group, tag=tag))
        requests = dist.batch_isend_irecv(ops) if ops else []
        if self.stats is not None:
            row_bytes = 2 * math.prod(send.shape[2:]) * send.element_size()
            self.stats.records.append(CommRecord(
                mode="ring", direction=direction, tensor=tensor, input_rows=rows_out, payload_rows=rows_out,
                sent_tokens=rows_out, recv_tokens=recv_rows, sent_bytes=rows_out * row_bytes,
                recv_bytes=recv_rows * row_bytes))
        return _PendingP2P(requests, send, recv)

    def rotate(self, kv_2TKD: torch.Tensor, direction: str) -> Iterator[torch.Tensor]:
        """Yield the block of each step, starting the next block's transfer before yielding this one."""
        block = kv_2TKD
        for index in range(self.cp):
            pending = None
            if index + 1 < self.cp:
                rows = self.ring.block_rows[self.ring.steps[index + 1].source]
                pending = self.start(block, rows, _KV_TAG, direction, "kv")
            yield block
            if pending is not None:
                block = pending.wait()


class _TravellingGrad:
    """The dK/dV buffers that travel with the blocks in the backward pass; ``finish`` returns this rank's."""

    def __init__(self, p2p: _RingP2P):
        self.p2p = p2p
        self.own: torch.Tensor | None = None
        self.pending: _PendingP2P | None = None

    def take(self, index: int, step: RingStep, grad_block: torch.Tensor) -> None:
        if index == 0:
            self.own = grad_block
            return
        if self.pending is not None:  # what the previous ranks added to this block so far
            grad_block += self.pending.wait()
        ring = self.p2p.ring
        # the previous rank sends the buffer of the block this rank hosts next (at the last step: its own)
        next_source = ring.steps[(index + 1) % len(ring.steps)].source
        self.pending = self.p2p.start(grad_block, ring.block_rows[next_source], _DKV_TAG, "backward", "dkv")

    def finish(self) -> torch.Tensor:
        assert self.own is not None
        if self.pending is not None:
            self.own += self.pending.wait()
            self.pending = None
        return self.own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, k_TKD, v_TKD, p2p: _RingP2P, backend: str):
        kv = torch.stack((k_TKD, v_TKD))
        out, lse = _forward_steps(q_THD, p2p.ring, p2p.rotate(kv, "forward"), backend)
        ctx.save_for_backward(q_THD, kv, out, lse)
        ctx.p2p, ctx.backend = p2p, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, out, lse = ctx.saved_tensors
        p2p = ctx.p2p
        travelling = _TravellingGrad(p2p)
        dq = _backward_steps(grad_out, q, out, lse, p2p.ring, p2p.rotate(kv, "backward"), ctx.backend,
                             travelling.take)
        dkv = travelling.finish().to(kv.dtype)
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, ring: RingSchedule,
                   group=None, backend: str = "reference", stats: CommStats | None = None) -> torch.Tensor:
    """Attention of this rank's queries, ``out_THD``, with K/V rotating around the ring; run on all ranks.

    Args:
        q_THD: this rank's queries, (T, H, D), in local layout order.
        k_TKD: this rank's keys, (T, K, D): its block, with ``v_TKD``.
        v_TKD: this rank's values, (T, K, D).
        ring: this rank's RingSchedule (``meta.ring``), on q's device.
        group: the CP process group (None: the default group); unused with one rank.
        backend: a concrete backend (``resolve_backend``), one of BACKENDS.
        stats: a CommStats that records every transfer (one record per step and tensor), or None.

    Differentiable in q, k and v; ``cp_attention(..., comm="ring")`` calls this after checking its inputs.
    """
    return _RingAttention.apply(q_THD, k_TKD, v_TKD, _RingP2P(ring, group, stats), backend)


class _RingFromBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, ring: RingSchedule, backend: str, *blocks):
        out, lse = _forward_steps(q_THD, ring, (blocks[s.source] for s in ring.steps), backend)
        ctx.save_for_backward(q_THD, out, lse, *blocks)
        ctx.ring, ctx.backend = ring, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, *blocks = ctx.saved_tensors
        grads = [None] * len(blocks)

        def take(_index, step, grad_block):
            grads[step.source] = grad_block if grads[step.source] is None else grads[step.source] + grad_block

        dq = _backward_steps(grad_out, q, out, lse, ctx.ring, (blocks[s.source] for s in ctx.ring.steps),
                             ctx.backend, take)
        return (dq, None, None, *(g.to(b.dtype) for g, b in zip(grads, blocks)))


def ring_attention_from_blocks(q_THD: torch.Tensor, blocks: list[torch.Tensor], ring: RingSchedule,
                               backend: str = "reference") -> torch.Tensor:
    """What ``ring_attention`` computes on this rank, given every rank's block instead of a process group.

    ``blocks[r]`` is rank r's K/V, (2, T_r, K, D). The same step kernels and merges run, without transfers;
    differentiable in q and every block (each block's gradient sums its steps' shares). For single-process
    emulation and for timing a rank's block-wise attention.
    """
    return _RingFromBlocks.apply(q_THD, ring, backend, *blocks)
