"""Differentiable, asynchronous K/V exchanges between CP ranks; every collective takes an explicit group.

``start_exchange`` launches the forward collective without waiting and returns a ``PendingExchange``;
``PendingExchange.wait()`` returns the receive buffer. Both ends are autograd Functions, so the backward
pass runs the reverse collective the same way: the receive buffer's gradient (dK/dV of every key this rank
borrowed) is sent back to the owners, started as soon as it is ready and waited for only when the owners'
send buffer gradient is needed. The reverse collectives:

- all-gather (``allgather``, ``full``) -> reduce-scatter (sum): each owner gets the sum of its rows'
  gradients over all ranks;
- ``all_to_all_single`` with uneven splits (``a2a``) -> the same call with the splits swapped.

Buffers are ``(rows, 2, K, D)``: K and V travel together in one collective. Rows are tokens.
``all_to_all`` is the ``a2a`` path for rows of any shape, waited for at once (the recurrent layers' state maps
and convolution inputs: ``flashcp.runtime.recurrent.cp``).

Precision: partial dK/dV are summed in float32 (``lse_dtype``: float32 or wider) whatever the input dtype.
The send buffer handed to ``start_exchange`` is in that accumulation dtype; K/V travel forward in the
``wire_dtype`` (the model's dtype), and the receive buffer comes back in the accumulation dtype, so every
gradient sum downstream of the exchange runs in float32. Backward:

- reduce-scatter (``allgather``, ``full``): the sum over ranks happens inside the collective, so it runs in
  float32 on the wire: with bf16 K/V the backward moves twice the bytes of the forward,
  ``(cp - 1) * rows * 2 * K * D * 4`` bytes sent per rank and layer instead of ``... * 2`` (``rows`` the
  slot: ``P`` for ``allgather``, ``Q`` for ``full``).
- ``a2a``: every rank sums its own partials in float32 and sends one ``wire_dtype`` row per borrowed token;
  the owner receives the ranks' rows separately and adds them in float32 (the send buffer's gradient, then
  the index-select that packed it). No extra bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flashcp.runtime.meta import Exchange

__all__ = ["CommRecord", "CommStats", "PendingExchange", "all_to_all", "start_exchange"]

# torch >= 2.13 names the tensor-in/tensor-out collectives *_single and deprecates the older names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class CommRecord:
    """One collective as it was issued, measured from the tensors handed to it."""

    mode: str
    """``allgather``, ``a2a``, ``full`` or ``ring`` (one record per ring step)."""
    direction: str
    """``forward`` or ``backward``: the pass that issued it."""
    tensor: str
    """``kv`` (K/V to the ranks that need it) or ``dkv`` (dK/dV back to the owners). The collective modes
    move K/V forward and dK/dV backward; the ring moves K/V forward and both backward. A hybrid's recurrent
    layers (``flashcp.runtime.recurrent``): ``state`` / ``dstate`` (state maps and their gradients) and
    ``conv`` / ``dconv`` (convolution inputs), both ``a2a``."""
    input_rows: int
    """Rows of this rank's collective input (an all-gather slot includes padding)."""
    payload_rows: int
    """Real tokens among them (forward); the rows of gradient returned to this rank's tokens (backward)."""
    sent_tokens: int
    """Tokens that left this rank: ``(cp-1) * input_rows`` for an all-gather or reduce-scatter."""
    recv_tokens: int
    """Tokens that arrived at this rank."""
    sent_bytes: int
    """``sent_tokens`` times the bytes of one row (K and V, all heads)."""
    recv_bytes: int
    """``recv_tokens`` times the bytes of one row."""


@dataclass(slots=True)
class CommStats:
    """Collects a CommRecord for every collective issued by ``cp_attention(..., stats=...)``."""

    records: list[CommRecord] = field(default_factory=list)
    """In issue order."""

    def total(self, key: str, direction: str | None = None, tensor: str | None = None) -> int:
        """Sum of ``key`` (e.g. ``sent_bytes``) over the records, optionally of one direction / tensor."""
        return sum(getattr(r, key) for r in self.records
                   if direction in (None, r.direction) and tensor in (None, r.tensor))

    def clear(self) -> None:
        """Forget all records."""
        self.records.clear()


def _record(stats: CommStats | None, exchange: Exchange, direction: str, inp: torch.Tensor, out: torch.Tensor,
            cp: int, payload: int, tensor: str = "kv") -> None:
    if stats is None:
        return
    row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
    rows_in, rows_out = int(inp.shape[0]), int(out.shape[0])
    if exchange.mode == "a2a":
        sent, recv = rows_in, rows_out
    elif direction == "forward":  # all-gather: the slot goes to every peer, every peer's slot comes in
        sent, recv = (cp - 1) * rows_in, rows_out - rows_in
    else:  # reduce-scatter: every peer's share of the buffer goes out, every peer's share of mine comes in
        sent, recv = rows_in - rows_out, (cp - 1) * rows_out
    stats.records.append(CommRecord(mode=exchange.mode, direction=direction,
                                    tensor=tensor if direction == "forward" else f"d{tensor}", input_rows=rows_in,
                                    payload_rows=payload, sent_tokens=sent, recv_tokens=recv,
                                    sent_bytes=sent * row_bytes, recv_bytes=recv * row_bytes))


class _ExchangeState:
    """What the two autograd Functions of one exchange share."""

    __slots__ = ("exchange", "group", "cp", "stats", "tensor", "wire_dtype", "work", "grad_work", "grad_recv",
                 "grad_send")

    def __init__(self, exchange: Exchange, group, cp: int, stats: CommStats | None, wire_dtype: torch.dtype,
                 tensor: str = "kv"):
        self.exchange, self.group, self.cp, self.stats, self.tensor = exchange, group, cp, stats, tensor
        self.wire_dtype = wire_dtype
        self.work: Any = None  # the forward collective's handle until waited for
        self.grad_work: Any = None  # the backward collective's handle until waited for
        self.grad_recv: torch.Tensor | None = None  # kept alive while the backward collective reads it
        self.grad_send: torch.Tensor | None = None


def _launch(state: _ExchangeState, inp: torch.Tensor, out: torch.Tensor, direction: str):
    ex = state.exchange
    if ex.mode == "a2a":
        splits_in, splits_out = ex.send_splits, ex.recv_splits
        if direction == "backward":
            splits_in, splits_out = splits_out, splits_in
        work = dist.all_to_all_single(out, inp, output_split_sizes=list(splits_out),
                                      input_split_sizes=list(splits_in), group=state.group, async_op=True)
    elif direction == "forward":
        work = _all_gather(out, inp, group=state.group, async_op=True)
    else:
        work = _reduce_scatter(out, inp, group=state.group, async_op=True)
    payload = ex.num_payload
    _record(state.stats, ex, direction, inp, out, state.cp, payload, state.tensor)
    return work


class _StartExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_RKD, state: _ExchangeState):
        wire = send_RKD.to(state.wire_dtype).contiguous()
        recv = wire.new_empty((state.exchange.recv_rows, *wire.shape[1:]))
        state.work = _launch(state, wire, recv, "forward")
        state.grad_send = wire  # kept alive until the collective is done
        ctx.state, ctx.acc_dtype = state, send_RKD.dtype
        return recv

    @staticmethod
    def backward(ctx, _grad_recv):
        state = ctx.state
        state.grad_work.wait()
        grad_send = state.grad_send.to(ctx.acc_dtype)  # a2a partials arrive in the wire dtype: sum in float32
        state.grad_work = state.grad_recv = state.grad_send = None
        return grad_send, None


class _WaitExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, state: _ExchangeState, acc_dtype: torch.dtype):
        state.work.wait()
        state.work = state.grad_send = None
        ctx.state, ctx.recv_shape, ctx.wire_dtype = state, recv.shape, recv.dtype
        return recv.to(acc_dtype)

    @staticmethod
    def backward(ctx, grad_recv):
        state = ctx.state
        ex = state.exchange
        # a reduce-scatter sums inside the collective: keep float32 on the wire; a2a rows are not summed there
        wire_dtype = ctx.wire_dtype if ex.mode == "a2a" else grad_recv.dtype
        state.grad_recv = grad_recv.to(wire_dtype).contiguous()
        state.grad_send = state.grad_recv.new_empty((ex.send_rows, *grad_recv.shape[1:]))
        state.grad_work = _launch(state, state.grad_recv, state.grad_send, "backward")
        # _StartExchange's backward takes its gradient from ``state``; this one only orders the two
        return torch.zeros((), dtype=ctx.wire_dtype, device=grad_recv.device).expand(ctx.recv_shape), None, None


class _TieToBuffer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, recv):
        ctx.recv_shape, ctx.recv_dtype = recv.shape, recv.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, grad_out.new_zeros(ctx.recv_shape, dtype=ctx.recv_dtype)


class PendingExchange:
    """An exchange whose forward collective is in flight; ``wait()`` returns the receive buffer."""

    def __init__(self, recv: torch.Tensor, state: _ExchangeState, acc_dtype: torch.dtype):
        self._recv, self._state, self._acc_dtype = recv, state, acc_dtype

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; returns the receive buffer, (recv_rows, 2, K, D).

        The buffer is in the send buffer's (accumulation) dtype.
        """
        return _WaitExchange.apply(self._recv, self._state, self._acc_dtype)

    @staticmethod
    def tie(out: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Return ``out`` unchanged, with ``recv`` (the waited buffer) in its autograd graph.

        Every rank must take part in the backward collective, also a rank that used none of what it received
        (all its shards local-only): tying the buffer to its output gives it a (zero) gradient, so the
        reverse collective is issued on that rank too.
        """
        return _TieToBuffer.apply(out, recv)


def start_exchange(send_RKD: torch.Tensor, exchange: Exchange, group=None, cp: int | None = None,
                   stats: CommStats | None = None, wire_dtype: torch.dtype | None = None,
                   tensor: str = "kv") -> PendingExchange:
    """Launch ``exchange``'s forward collective on ``group`` without waiting.

    Args:
        send_RKD: this rank's collective input, (exchange.send_rows, 2, K, D); differentiable. Its dtype is
            the one gradients are summed in (float32 for bf16 K/V, see the module docstring).
        exchange: the comm mode's Exchange from this rank's CPAttnMeta.
        group: the CP process group (None: the default group); its ranks are the plan's ranks.
        cp: the group's size (looked up when None).
        stats: where to record what was sent and received, or None.
        wire_dtype: the dtype K/V travel in (None: send_RKD's).
        tensor: what the rows are, for ``stats`` (``CommRecord.tensor``; backward records ``"d" + tensor``).
    """
    if send_RKD.shape[0] != exchange.send_rows:
        raise ValueError(f"the send buffer has {send_RKD.shape[0]} rows, the {exchange.mode} exchange needs "
                         f"{exchange.send_rows}")
    cp = dist.get_world_size(group) if cp is None else cp
    state = _ExchangeState(exchange, group, cp, stats, wire_dtype or send_RKD.dtype, tensor)
    recv = _StartExchange.apply(send_RKD, state)
    return PendingExchange(recv, state, send_RKD.dtype)


def all_to_all(send: torch.Tensor, send_splits, recv_splits, group=None, cp: int | None = None,
               stats: CommStats | None = None, tensor: str = "rows") -> torch.Tensor:
    """``all_to_all_single`` with uneven splits, differentiable, waited for: ``start_exchange``'s ``a2a``.

    Args:
        send: (sum(send_splits), ...) rows for each rank of the group, rank after rank.
        send_splits: (cp,) rows to each rank.
        recv_splits: (cp,) rows from each rank; what each sends this one.
        group: the process group (None: the default group).
        cp: the group's size (looked up when None).
        stats: where to record what was sent and received (as ``tensor``, ``"d" + tensor`` backward), or None.
        tensor: what the rows are (``CommRecord.tensor``).

    Returns (sum(recv_splits), ...) the rows from each rank, rank after rank, in ``send``'s dtype. Backward: the
    same call with the splits swapped, so each row's gradient returns to its sender.
    """
    send_splits, recv_splits = tuple(int(n) for n in send_splits), tuple(int(n) for n in recv_splits)
    send_rows, recv_rows = sum(send_splits), sum(recv_splits)
    exchange = Exchange(mode="a2a", active=True, send_index=torch.arange(send_rows), send_rows=send_rows,
                        recv_rows=recv_rows, send_splits=send_splits, recv_splits=recv_splits,
                        kv_index=torch.zeros(0, dtype=torch.long), wire_send_tokens=send_rows,
                        wire_recv_tokens=recv_rows)
    return start_exchange(send, exchange, group, cp, stats, tensor=tensor).wait()
