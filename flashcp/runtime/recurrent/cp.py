"""Recurrent layers across CP ranks: each piece of a document starts from the state the pieces before it leave.

One call per layer on every rank of the CP group; the process group is passed explicitly. The scheme (a
prefix scan of affine state maps, then a second pass from the true start state):

1. every rank runs each piece it *contributes* (``RecurrentMeta.contributes``: not the last piece of a cut
   document) from a known start and reads off the piece's affine map of the state, ``S_end = T_p S_start +
   U_p``: Mamba-2's transition ``T_p`` is a scalar per head (``exp(A * sum dt)``) and ``U_p`` the final
   state from zero; Gated DeltaNet's ``T_p`` is a K x K matrix per head, obtained with ``U_p`` in one run from
   the state ``[I | 0]`` with values ``[0 | v]`` (the identity's columns carry the transition);
2. one ``all_to_all_single`` of the maps on the CP group with uneven splits (``RecurrentMeta.maps``): each map
   goes to the other ranks holding a later piece of its document, once each (gathered from the local maps with
   ``index_select``); a later piece on its own rank reads it locally, so this rank's own split is 0 and no row
   is padding;
3. each rank composes, for each of its pieces with ``start > 0``, its true start state from its predecessors'
   maps in document order (``S = T_j S + U_j``), reading ``cat(its own maps, the received maps)``;
4. the pieces are run from their true start states. A piece that starts its document and was run in step 1
   from zero (SSD) or ``[I | 0]`` (GDN) keeps that run's output; the others run once more (the extra work of a
   split piece: one more run of the middle pieces, one run of ``K`` extra value columns for GDN).

Bytes per contributed piece, destination and layer (float32 maps): GDN ``4 * H * K * (K + V)``; SSD ``4 * H *
(1 + P * S)``. The short convolution (``cp_causal_conv1d``) moves, in its own all-to-all before the layer, each
input token that another rank's piece needs among its ``W - 1`` inputs before it, once per such rank: ``4 *
F`` bytes per token (``RecurrentMeta.conv_tails``). ``flashcp.costmodel.recurrent`` has the per-plan formulas.
A document held whole by one rank is in no exchange; a sequence with no cut document issues no collective at
all, and an exchange in which no row crosses ranks is skipped (on every rank alike: the decision comes from the
plan).

Backward: the all-to-all's reverse is the same call with the splits swapped (``comm.all_to_all``), so the
gradient of each row returns to the rank that sent it, and the ``index_select`` that packed the send buffer
sums a map's gradients over its destinations. Each exchange is tied into the graph at both ends (its input to
the layer's inputs, its output to the layer's output), so every rank issues the reverse collectives, also a
rank that used none of what it received, and in the same order: the layers' reverse order.

Kernels: each layer takes ``backend=`` (``flashcp.runtime.recurrent.backends``: ``"reference"``, ``"fla"``,
``"mamba_ssm"`` or ``"auto"``); steps 1 and 4 are two calls of that backend's kernel over segments, with the
per-segment initial states the libraries' varlen entry points take.

Shape legend: as ``flashcp.runtime.recurrent.chunked`` (``T`` this rank's tokens).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from flashcp.runtime.comm import CommStats, all_to_all
from flashcp.runtime.recurrent import backends
from flashcp.runtime.recurrent.chunked import causal_conv1d, compute_dtype, normalize_qk
from flashcp.runtime.recurrent.meta import RecurrentMeta, Route

__all__ = ["cp_causal_conv1d", "cp_gated_delta_rule", "cp_ssd"]

class _Tie(torch.autograd.Function):
    """``out`` unchanged, with ``others`` in its graph (zero gradient): it orders the backward collectives."""

    @staticmethod
    def forward(ctx, out, *others):
        ctx.others = [(o.shape, o.dtype) for o in others]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.others)


def _exchange(local: torch.Tensor, route: Route, meta: RecurrentMeta, group, inputs: tuple[torch.Tensor, ...],
              stats: CommStats | None, tensor: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``cat(local, received rows)`` of ``route`` and the receive buffer (None when the route is inactive).

    The send buffer is tied after the layer's ``inputs``; the caller ties the receive buffer to its output.
    """
    if not route.active:
        return local, None
    send = local.index_select(0, torch.from_numpy(route.send_index).to(local.device))
    differentiable = tuple(x for x in inputs if x.requires_grad)
    received = all_to_all(_Tie.apply(send, *differentiable), route.send_splits, route.recv_splits, group, meta.cp,
                          stats, tensor)
    return torch.cat((local, received)), received


def _tied(out: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
    return out if received is None else _Tie.apply(out, received)


def _check(meta: RecurrentMeta, num_tokens: int, group) -> None:
    if num_tokens != meta.num_tokens:
        raise ValueError(f"rank {meta.rank} holds {meta.num_tokens} tokens but the inputs have {num_tokens}")
    if meta.active and (dist.get_world_size(group) != meta.cp or dist.get_rank(group) != meta.rank):
        raise ValueError(f"the meta is for rank {meta.rank} of {meta.cp}, but this process is rank "
                         f"{dist.get_rank(group)} of a group of {dist.get_world_size(group)}")


def cp_causal_conv1d(x_TF: torch.Tensor, weight_FW: torch.Tensor, bias_F: torch.Tensor | None,
                     meta: RecurrentMeta, group=None, activation: str | None = "silu", *,
                     backend: str = "auto", stats: CommStats | None = None) -> torch.Tensor:
    """The short causal convolution of this rank's pieces, each continuing its document: ``y_TF``.

    Args:
        x_TF: this rank's inputs, (T, F), in local layout order.
        weight_FW: (F, W) depthwise filters.
        bias_F: (F,) or None.
        meta: this rank's RecurrentMeta.
        group: the CP process group (None: the default group).
        activation: ``"silu"`` or None.
        backend: the convolution's kernel (``backends.RECURRENT_BACKENDS`` or ``"auto"``).
        stats: a ``CommStats`` recording the all-to-all (``conv`` forward, ``dconv`` backward), or None.

    Each piece needs the ``W - 1`` inputs before it in its document: one all-to-all of the input tokens other
    ranks' pieces need (float32 or wider; ``RecurrentMeta.conv_tails``). Differentiable in x, weight and bias;
    the inputs' gradients go back to their owners.
    """
    _check(meta, x_TF.shape[0], group)
    width = weight_FW.shape[1]
    kernel = backends.conv_kernel(backend, x_TF, width)
    if not meta.active or width == 1:
        return causal_conv1d(x_TF, weight_FW, bias_F, meta.cu_seqlens, activation=activation, kernel=kernel)
    route = meta.conv_tails(width)
    wide = x_TF.to(compute_dtype(x_TF.dtype))
    pool, received = _exchange(wide, route, meta, group, (x_TF,), stats, "conv")
    pool = torch.cat((pool, pool.new_zeros(1, x_TF.shape[1])))  # the inputs before a document's start
    tails = pool.index_select(0, torch.from_numpy(route.read_index).to(x_TF.device))
    y = causal_conv1d(x_TF, weight_FW, bias_F, meta.cu_seqlens, tails.view(-1, width - 1, x_TF.shape[1]),
                      activation=activation, kernel=kernel)
    return _tied(y, received)


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


def _start_states(meta: RecurrentMeta, pieces: np.ndarray, pool: torch.Tensor, compose, zero: torch.Tensor):
    """The true start state of each of ``pieces``: its predecessors' maps composed in document order.

    ``pool``: this rank's maps, then the received ones (``RecurrentMeta.predecessors`` indexes it).
    """
    states = []
    for piece in pieces:
        state = zero
        for row in meta.predecessors(piece):
            state = compose(pool[row], state)
        states.append(state)
    return torch.stack(states) if states else zero.new_zeros((0, *zero.shape))


def cp_gated_delta_rule(q_TGK: torch.Tensor, k_TGK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                        beta_TH: torch.Tensor, meta: RecurrentMeta, group=None, *, chunk_size: int = 64,
                        scale: float | None = None, use_qk_l2norm: bool = True,
                        backend: str = "auto", stats: CommStats | None = None) -> torch.Tensor:
    """Gated DeltaNet over this rank's pieces, each from its document's true state: ``out_THV``.

    Args: as ``chunked.chunk_gated_delta_rule`` for this rank's tokens in local layout order (no segments or
    states: they come from ``meta``), plus ``meta`` (this rank's RecurrentMeta) and ``group`` (the CP process
    group, None: the default), ``backend`` (``backends.RECURRENT_BACKENDS`` or ``"auto"``) and ``stats`` (a
    ``CommStats`` recording the all-to-all: ``state`` forward, ``dstate`` backward; or None). Sends ``4 * H *
    K * (K + V)`` bytes per contributed piece and destination (module docstring). Differentiable in q, k, v, g
    and beta.
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
    # 2. one all-to-all of the maps
    pool, received = _exchange(maps.to(q.dtype), meta.maps, meta, group, (q_TGK, k_TGK, v_THV, g_TH, beta_TH),
                               stats, "state")
    # 3. true start states, 4. the other pieces from them
    states = _start_states(meta, rerun, pool, lambda m, s: m[..., :head_k] @ s + m[..., head_k:],
                           v.new_zeros(num_heads, head_k, head_v))
    index, cu = meta.piece_tokens(rerun)
    index = index.to(v.device)
    q_p, k_p, v_p, g_p, beta_p = (x.index_select(0, index) for x in (q, k, v, g, beta))
    out, _ = run(q_p, k_p, v_p, g_p, beta_p, cu, states)
    parts.append((index, out.to(q.dtype)))
    return _tied(_assemble(parts, meta.num_tokens).to(q_TGK.dtype), received)


def cp_ssd(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGS: torch.Tensor,
           C_TGS: torch.Tensor, meta: RecurrentMeta, group=None, *, D_H: torch.Tensor | None = None,
           chunk_size: int = 64, backend: str = "auto", stats: CommStats | None = None) -> torch.Tensor:
    """Mamba-2 SSD over this rank's pieces, each from its document's true state: ``y_THP``.

    Args: as ``chunked.chunk_ssd`` for this rank's tokens in local layout order, plus ``meta``, ``group``,
    ``backend`` (``backends.RECURRENT_BACKENDS`` or ``"auto"``) and ``stats`` (as ``cp_gated_delta_rule``).
    Sends ``4 * H * (1 + P * S)`` bytes per contributed piece and destination. Differentiable in x, dt, A, B, C
    and D.
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
    # 2. one all-to-all of [T_p, U_p] per head
    maps = torch.cat((decay[..., None], final.to(dtype).reshape(len(mapped), num_heads, head_p * state_size)), dim=2)
    pool, received = _exchange(maps, meta.maps, meta, group, (x_THP, dt_TH, A_H, B_TGS, C_TGS), stats, "state")
    # 3. true start states, 4. the other pieces from them
    states = _start_states(meta, rerun, pool,
                           lambda m, s: m[:, :1, None] * s + m[:, 1:].view(num_heads, head_p, state_size),
                           x_THP.new_zeros(num_heads, head_p, state_size, dtype=dtype))
    index, cu = meta.piece_tokens(rerun)
    index = index.to(x_THP.device)
    x_p, dt_p, B_p, C_p = (t.index_select(0, index) for t in (x_THP, dt_TH, B_TGS, C_TGS))
    out, _ = backends.ssd(x_p, dt_p, A_H, B_p, C_p, cu, states, chunk_size, carried=meta.piece_start[rerun] > 0,
                          backend=backend)
    parts.append((index, out.to(dtype)))
    return _tied(skip(_assemble(parts, meta.num_tokens)).to(x_THP.dtype), received)
