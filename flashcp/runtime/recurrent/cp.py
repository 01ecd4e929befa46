"""Recurrent layers across CP ranks: each piece of a document starts from the state the pieces before it leave.

One call per layer on every rank of the CP group; the process group is passed explicitly. The scheme (a
prefix scan of affine state maps, then a second pass from the true start state):

1. every rank runs each piece it *contributes* (``RecurrentMeta.contributes``: not the last piece of a cut
   document) from a known start and reads off the piece's affine map of the state, ``S_end = T_p S_start +
   U_p``: Mamba-2's transition ``T_p`` is a scalar per head (``exp(A * sum dt)``) and ``U_p`` the final
   state from zero; Gated DeltaNet's ``T_p`` is a K x K matrix per head, obtained with ``U_p`` in one run from
   the state ``[I | 0]`` with values ``[0 | v]`` (the identity's columns carry the transition);
2. one all-gather of the maps on the CP group: ``slot`` rows per rank, sizes independent of the pieces'
   lengths;
3. each rank composes, for each of its pieces with ``start > 0``, its true start state from its predecessors'
   maps in document order (``S = T_j S + U_j``);
4. the pieces are run from their true start states. A piece that starts its document and was run in step 1
   from zero (SSD) or ``[I | 0]`` (GDN) keeps that run's output; the others run once more (the extra work of a
   split piece: one more run of the middle pieces, one run of ``K`` extra value columns for GDN).

Bytes per contributed piece and layer (float32 maps, ``cp - 1`` copies sent by an all-gather): GDN ``4 * H *
K * (K + V)``; SSD ``4 * H * (1 + P * S)``; the short convolution's tail ``4 * (W - 1) * F``, its own
all-gather before the layer (``cp_causal_conv1d``). A document held whole by one rank is in no exchange; a
sequence with no cut document issues no collective at all (on every rank alike).

Backward: the all-gather's reverse is a reduce-scatter (sum), so the gradient of each state map flows back to
the rank that computed it. Each exchange is tied into the graph at both ends (its input to the layer's inputs,
its output to the layer's output), so every rank issues the reverse collectives, also a rank that used none of
what it received, and in the same order: the layers' reverse order.

Kernels: each layer takes ``backend=`` (``flashcp.runtime.recurrent.backends``: ``"reference"``, ``"fla"``,
``"mamba_ssm"`` or ``"auto"``); steps 1 and 4 are two calls of that backend's kernel over segments, with the
per-segment initial states the libraries' varlen entry points take.

Shape legend: as ``flashcp.runtime.recurrent.chunked`` (``T`` this rank's tokens).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from flashcp.runtime.recurrent import backends
from flashcp.runtime.recurrent.chunked import causal_conv1d, compute_dtype, normalize_qk
from flashcp.runtime.recurrent.meta import RecurrentMeta

__all__ = ["cp_causal_conv1d", "cp_gated_delta_rule", "cp_ssd"]

# torch >= 2.13 names the tensor-in/tensor-out collectives *_single and deprecates the older names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """(rows, ...) per rank -> (cp * rows, ...), rank r's rows at ``[r * rows, (r + 1) * rows)``; backward sums."""

    @staticmethod
    def forward(ctx, send, group, cp: int):
        send = send.contiguous()
        out = send.new_empty((cp * send.shape[0], *send.shape[1:]))
        _all_gather(out, send, group=group)
        ctx.group, ctx.cp = group, cp
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad = grad_out.new_empty((grad_out.shape[0] // ctx.cp, *grad_out.shape[1:]))
        _reduce_scatter(grad, grad_out.contiguous(), group=ctx.group)
        return grad, None, None


class _Tie(torch.autograd.Function):
    """``out`` unchanged, with ``others`` in its graph (zero gradient): it orders the backward collectives."""

    @staticmethod
    def forward(ctx, out, *others):
        ctx.others = [(o.shape, o.dtype) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.others)


def _exchange(send: torch.Tensor, meta: RecurrentMeta, group, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """All-gather ``send`` (slot, ...) over the CP group, tied after the layer's ``inputs``."""
    differentiable = tuple(x for x in inputs if x.requires_grad)
    return _AllGather.apply(_Tie.apply(send, *differentiable), group, meta.cp)


def _check(meta: RecurrentMeta, num_tokens: int, group) -> None:
    if num_tokens != meta.num_tokens:
        raise ValueError(f"rank {meta.rank} holds {meta.num_tokens} tokens but the inputs have {num_tokens}")
    if meta.active and (dist.get_world_size(group) != meta.cp or dist.get_rank(group) != meta.rank):
        raise ValueError(f"the meta is for rank {meta.rank} of {meta.cp}, but this process is rank "
                         f"{dist.get_rank(group)} of a group of {dist.get_world_size(group)}")


def _padded(rows: torch.Tensor, slot: int) -> torch.Tensor:
    """(c, ...) -> (slot, ...) with zero rows after."""
    return torch.cat((rows, rows.new_zeros((slot - rows.shape[0], *rows.shape[1:]))))


def cp_causal_conv1d(x_TF: torch.Tensor, weight_FW: torch.Tensor, bias_F: torch.Tensor | None,
                     meta: RecurrentMeta, group=None, activation: str | None = "silu", *,
                     backend: str = "auto") -> torch.Tensor:
    """The short causal convolution of this rank's pieces, each continuing its document: ``y_TF``.

    Args:
        x_TF: this rank's inputs, (T, F), in local layout order.
        weight_FW: (F, W) depthwise filters.
        bias_F: (F,) or None.
        meta: this rank's RecurrentMeta.
        group: the CP process group (None: the default group).
        activation: ``"silu"`` or None.
        backend: the convolution's kernel (``backends.RECURRENT_BACKENDS`` or ``"auto"``).

    Each piece needs the ``W - 1`` inputs before it in its document: one all-gather of every contributed
    piece's last ``W - 1`` inputs (float32 or wider), ``slot * (W - 1)`` rows per rank. Differentiable in x,
    weight and bias; the tails' gradients go back to their owners.
    """
    _check(meta, x_TF.shape[0], group)
    width = weight_FW.shape[1]
    kernel = backends.conv_kernel(backend, x_TF, width)
    if not meta.active or width == 1:
        return causal_conv1d(x_TF, weight_FW, bias_F, meta.cu_seqlens, activation=activation, kernel=kernel)
    send_index, recv_index = (i.to(x_TF.device) for i in meta.conv_tails(width))
    features = x_TF.shape[1]
    wide = x_TF.to(compute_dtype(x_TF.dtype))
    send = torch.cat((wide, wide.new_zeros(1, features))).index_select(0, send_index)
    gathered = _exchange(send.view(meta.slot, width - 1, features), meta, group, (x_TF,))
    flat = gathered.view(-1, features)
    tails = torch.cat((flat, flat.new_zeros(1, features))).index_select(0, recv_index)
    y = causal_conv1d(x_TF, weight_FW, bias_F, meta.cu_seqlens, tails.view(-1, width - 1, features),
                      activation=activation, kernel=kernel)
    return _Tie.apply(y, gathered)


def _split_runs(meta: RecurrentMeta) -> tuple[np.ndarray, np.ndarray]:
    """(pieces run for their maps, pieces run from their true start): first-of-document contributions keep step 1."""
    mapped = np.flatnonzero(meta.contributes)
    rerun = np.flatnonzero(~(meta.contributes & (meta.piece_start == 0)))
    return mapped, rerun


def _assemble(parts: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """Rows of each ``(token_index, rows)`` part put back at their token positions."""
    index = torch.cat([i for i, _ in parts])
    order = torch.empty_like(index)
    order[index] = torch.arange(num_tokens, device=index.device)
    return torch.cat([rows for _, rows in parts]).index_select(0, order)


def _start_states(meta: RecurrentMeta, pieces: np.ndarray, gathered: torch.Tensor, compose, zero: torch.Tensor):
    """The true start state of each of ``pieces``: its predecessors' maps composed in document order."""
    states = []
    for piece in pieces:
        state = zero
        for row in meta.predecessors(piece):
            state = compose(gathered[row], state)
        states.append(state)
    return torch.stack(states) if states else zero.new_zeros((0, *zero.shape))


def cp_gated_delta_rule(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                        beta_TH: torch.Tensor, meta: RecurrentMeta, group=None, *, chunk_size: int = 64,
                        scale: float | None = None, use_qk_l2norm: bool = True,
                        backend: str = "auto") -> torch.Tensor:
    """Gated DeltaNet over this rank's pieces, each from its document's true state: ``out_THV``.

    Args: as ``chunked.chunk_gated_delta_rule`` for this rank's tokens in local layout order (no segments or
    states: they come from ``meta``), plus ``meta`` (this rank's RecurrentMeta) and ``group`` (the CP process
    group, None: the default) and ``backend`` (``backends.RECURRENT_BACKENDS`` or ``"auto"``). Exchanges ``4 *
    H * K * (K + V)`` bytes per contributed piece (module docstring). Differentiable in q, k, v, g and beta.
    """
    _check(meta, v_THV.shape[0], group)
    q, k = normalize_qk(q_TGK, k_TGK, v_THV.shape[1], scale, use_qk_l2norm)
    v, g, beta = (x.to(q.dtype) for x in (v_THV, g_TH, beta_TH))
    backend = backends.resolve_recurrent_backend(backend, "gated_delta", v_THV)

    def run(*args):
        return backends.gated_delta(*args, chunk_size, dtype=v_THV.dtype, backend=backend)

    if not meta.active:
        return run(q, k, v, g, beta, meta.cu_seqlens, None)[0].to(q_TGK.dtype)
    num_heads, head_k, head_v = v.shape[1], k.shape[2], v.shape[2]
    mapped, rerun = _split_runs(meta)
    parts = []
    # 1. [T_p | U_p]: the contributed pieces from [I | 0] with values [0 | v]
    index, cu = meta.piece_tokens(mapped)
    index = index.to(v.device)
    augmented = torch.cat((v.new_zeros(index.shape[0], num_heads, head_k), v.index_select(0, index)), dim=2)
    eye = torch.eye(head_k, dtype=v.dtype, device=v.device).expand(len(mapped), num_heads, head_k, head_k)
    start = torch.cat((eye, v.new_zeros(len(mapped), num_heads, head_k, head_v)), dim=3)
    q_p, k_p, g_p, beta_p = (x.index_select(0, index) for x in (q, k, g, beta))
    out, maps = run(q_p, k_p, augmented, g_p, beta_p, cu, start)
    first = np.repeat(meta.piece_start[mapped] == 0, meta.piece_len[mapped])
    keep = torch.from_numpy(np.flatnonzero(first)).to(v.device)
    parts.append((index.index_select(0, keep), out.index_select(0, keep)[..., head_k:].to(q.dtype)))
    # 2. one all-gather of the maps
    gathered = _exchange(_padded(maps.to(q.dtype), meta.slot), meta, group, (q_TGK, k_TGK, v_THV, g_TH, beta_TH))
    # 3. true start states, 4. the other pieces from them
    states = _start_states(meta, rerun, gathered, lambda m, s: m[..., :head_k] @ s + m[..., head_k:],
                           v.new_zeros(num_heads, head_k, head_v))
    index, cu = meta.piece_tokens(rerun)
    index = index.to(v.device)
    q_p, k_p, v_p, g_p, beta_p = (x.index_select(0, index) for x in (q, k, v, g, beta))
    out, _ = run(q_p, k_p, v_p, g_p, beta_p, cu, states)
    parts.append((index, out.to(q.dtype)))
    return _Tie.apply(_assemble(parts, meta.num_tokens).to(q_TGK.dtype), gathered)


def cp_ssd(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGS: torch.Tensor,
           C_TGS: torch.Tensor, meta: RecurrentMeta, group=None, *, D_H: torch.Tensor | None = None,
           chunk_size: int = 64, backend: str = "auto") -> torch.Tensor:
    """Mamba-2 SSD over this rank's pieces, each from its document's true state: ``y_THP``.

    Args: as ``chunked.chunk_ssd`` for this rank's tokens in local layout order, plus ``meta``, ``group`` and
    ``backend`` (``backends.RECURRENT_BACKENDS`` or ``"auto"``). Exchanges ``4 * H * (1 + P * S)`` bytes per
    contributed piece. Differentiable in x, dt, A, B, C and D.
    """
    _check(meta, x_THP.shape[0], group)
    dtype = compute_dtype(x_THP.dtype)
    backend = backends.resolve_recurrent_backend(backend, "ssd", x_THP)

    def skip(y):
        return y if D_H is None else y + D_H.to(dtype)[:, None] * x_THP.to(dtype)

    if not meta.active:
        y, _ = backends.ssd(x_THP, dt_TH, A_H, B_TGS, C_TGS, meta.cu_seqlens, None, chunk_size, backend=backend)
        return skip(y.to(dtype)).to(x_THP.dtype)
    num_heads, head_p, state_size = x_THP.shape[1], x_THP.shape[2], B_TGS.shape[2]
    mapped, rerun = _split_runs(meta)
    parts = []
    # 1. (T_p, U_p): the decay over the piece and its final state from zero
    index, cu = meta.piece_tokens(mapped)
    index = index.to(x_THP.device)
    x_p, dt_p, B_p, C_p = (t.index_select(0, index) for t in (x_THP, dt_TH, B_TGS, C_TGS))
    out, final = backends.ssd(x_p, dt_p, A_H, B_p, C_p, cu, None, chunk_size,
                              carried=np.ones(len(mapped), dtype=bool), backend=backend)
    piece_of = torch.from_numpy(np.repeat(np.arange(len(mapped)), meta.piece_len[mapped])).to(x_THP.device)
    dt_sum = torch.zeros(len(mapped), num_heads, dtype=dtype, device=x_THP.device).index_add(
        0, piece_of, dt_p.to(dtype))
    decay = torch.exp(A_H.to(dtype) * dt_sum)
    first = np.repeat(meta.piece_start[mapped] == 0, meta.piece_len[mapped])
    keep = torch.from_numpy(np.flatnonzero(first)).to(x_THP.device)
    parts.append((index.index_select(0, keep), out.index_select(0, keep).to(dtype)))
    # 2. one all-gather of [T_p, U_p] per head
    maps = torch.cat((decay[..., None], final.to(dtype).reshape(len(mapped), num_heads, head_p * state_size)), dim=2)
    gathered = _exchange(_padded(maps, meta.slot), meta, group, (x_THP, dt_TH, A_H, B_TGS, C_TGS))
    # 3. true start states, 4. the other pieces from them
    states = _start_states(meta, rerun, gathered,
                           lambda m, s: m[:, :1, None] * s + m[:, 1:].view(num_heads, head_p, state_size),
                           x_THP.new_zeros(num_heads, head_p, state_size, dtype=dtype))
    index, cu = meta.piece_tokens(rerun)
    index = index.to(x_THP.device)
    x_p, dt_p, B_p, C_p = (t.index_select(0, index) for t in (x_THP, dt_TH, B_TGS, C_TGS))
    out, _ = backends.ssd(x_p, dt_p, A_H, B_p, C_p, cu, states, chunk_size, carried=meta.piece_start[rerun] > 0,
                          backend=backend)
    parts.append((index, out.to(dtype)))
    return _Tie.apply(skip(_assemble(parts, meta.num_tokens)).to(x_THP.dtype), gathered)
