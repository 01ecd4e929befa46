"""``cp_attention``: document-masked causal attention over a sequence sharded by a plan across CP ranks.

One call, on every rank of the CP group:

1. pack the K/V rows this rank contributes and start the exchange (asynchronous);
2. compute the *local* part (shards whose key prefix is all on this rank) while the exchange is in flight;
3. wait, then compute the *remote* part over keys gathered from ``cat(local K/V, receive buffer)``;
4. put both outputs back in local layout order.

Each query shard ``[start, end)`` of a document attends to that document's keys ``[0, end)`` with a
bottom-right aligned causal mask, so the result equals full-sequence attention with a document mask. The
backward pass sends dK/dV of borrowed keys back to their owners (see ``flashcp.runtime.comm``).

With ``comm="ring"`` (the Ring-Attn baselines) there is no collective: K/V blocks rotate around the ranks
point-to-point and every step's partial output is merged by log-sum-exp (``flashcp.runtime.ring``).

Gradient sums run in float32 (``lse_dtype``) whatever the input dtype: K/V are viewed in that dtype before
they are gathered, packed or concatenated and cast back to the input dtype only where a kernel reads them,
so the dK/dV partials of every kernel call, local or from other ranks, are added in float32 and rounded to
the input dtype once (``flashcp.runtime.comm`` for what that costs on the wire). The forward values are the
same: a bf16 -> float32 -> bf16 round trip is exact. It costs float32 copies of the gathered keys.

A layer kind (``flashcp.runtime.layer_kinds``: a sliding ``window``, a ``chunk``, learned ``sinks``, a logit
``softcap``) runs the same steps over the meta of its kind (``CPAttnMeta.for_kind``): each shard's keys are
only those the kind sees (the W-1 before the shard under a window, the shard's chunk under a chunk), so the
exchange moves only those, and under a chunk each shard is split at chunk boundaries into plain causal
sequences, so every backend runs chunk layers. The ``ring`` mode computes plain causal attention and refuses
them.

Steps 3-4 without the collective are ``attention_after_exchange``: given the receive buffer a rank would hold,
it computes that rank's output, so single-process emulation and benchmarks run exactly the same code.

Shape legend: ``T`` this rank's tokens, ``H`` query heads, ``K`` key/value heads (``H % K == 0``), ``D`` head
dim, ``R`` receive buffer rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashcp.runtime.comm import CommStats, start_exchange
from flashcp.runtime.kernels import fold_softmax_scale, lse_dtype, resolve_backend, varlen_attention
from flashcp.runtime.layer_kinds import LayerKind, check_sinks, kind_attention
from flashcp.runtime.meta import CPAttnMeta, Exchange, QueryPart
from flashcp.runtime.ring import ring_attention

__all__ = ["attention_after_exchange", "cp_attention", "local_attention", "pack_send", "remote_attention"]


def cp_attention(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: CPAttnMeta, group=None,
                 comm: str = "auto", backend: str = "auto", stats: CommStats | None = None,
                 softmax_scale: float | None = None, window: int | None = None, chunk: int | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Context-parallel attention of this rank's queries, ``out_THD``. Run it on all ranks of ``group``.

    Args:
        q_THD: this rank's queries, (T, H, D), in local layout order (its shards in plan row order).
        k_TKD: this rank's keys, (T, K, D), same dtype and device.
        v_TKD: this rank's values, (T, K, D).
        meta: this rank's CPAttnMeta (``batch.attn``); its tensors for the comm mode used are moved to q's
            device once (one copy) and cached.
        group: the CP process group whose ranks are the plan's ranks (None: the default group). Not needed
            when the plan has one rank or the chosen exchange moves nothing.
        comm: ``allgather``, ``a2a``, ``full``, ``ring`` or ``auto`` (``meta.auto_comm_for`` the K/V's element
            size, the same on every rank; never ``full`` or ``ring``, the baselines).
        backend: ``fa3``, ``fa4``, ``flash_attn``, ``torch_varlen``, ``reference`` or ``auto``
            (``flashcp.runtime.kernels``: ``auto`` warns once when it must run the reference kernel on a GPU).
        stats: a CommStats that records each collective issued, or None.
        softmax_scale: the factor on ``q . k`` before the softmax; None means ``1 / sqrt(D)``.
        window: sliding window W: a token sees itself and the W-1 tokens before it in its document (None: all).
        chunk: chunk length K: a token at position p of its document sees positions ``[K*floor(p/K), p]``.
        sinks: (H,) learned per-head logits added to the softmax denominator (gpt-oss), or None.
        softcap: c: scores ``c * tanh(s / c)`` before the mask (Gemma 2), or None.

    A backend that cannot run the window, chunk or soft-cap is refused by name, skipped by ``auto``. Differentiable
    in q, k, v and the sinks.
    """
    kind = LayerKind(window=window, chunk=chunk, softcap=softcap)
    if meta.resolve_comm(comm) == "ring" and not (kind.plain and sinks is None):
        raise ValueError(f"comm='ring' computes plain causal attention only, got {_kind_words(kind, sinks)}: use "
                         "comm allgather, a2a or full")
    meta, kind = _for_kind(meta, kind)
    mode = meta.resolve_comm(comm, k_TKD.element_size())
    meta = meta.to(q_THD.device, comm=mode)
    _check_inputs(q_THD, k_TKD, v_TKD, meta)
    check_sinks(sinks, q_THD.shape[1])
    backend = _resolve(backend, q_THD, kind, sinks, ring=mode == "ring")
    if mode == "ring":
        if meta.ring.active:
            _check_group(meta, group)
        # the ring's LSE kernels use 1/sqrt(D): fold the requested scale into q
        return ring_attention(fold_softmax_scale(q_THD, softmax_scale), k_TKD, v_TKD, meta.ring, group, backend, stats)
    exchange = meta.exchange(mode)
    wire_dtype = k_TKD.dtype
    k_TKD, v_TKD = _accumulating(k_TKD), _accumulating(v_TKD)
    pending = None
    if exchange.active:
        _check_group(meta, group)
        pending = start_exchange(pack_send(k_TKD, v_TKD, exchange), exchange, group, meta.cp, stats,
                                 wire_dtype=wire_dtype)
    out_local = local_attention(q_THD, k_TKD, v_TKD, meta, backend, softmax_scale, kind, sinks)
    if pending is not None:
        recv_RKD = pending.wait()
    else:  # nothing to exchange: every shard is local-only
        assert meta.remote.num_tokens == 0
        recv_RKD = k_TKD.new_zeros((0, 2, *k_TKD.shape[1:]))
    out_remote = remote_attention(q_THD, k_TKD, v_TKD, recv_RKD, meta, exchange, backend, softmax_scale, kind,
                                  sinks)
    out = _combine(out_local, out_remote, meta)
    if pending is not None and meta.remote.num_tokens == 0:
        out = pending.tie(out, recv_RKD)
    return out


def _kind_words(kind: LayerKind, sinks) -> str:
    words = [f"{name}={value}" for name, value in kind.kernel_args().items() if value is not None]
    return ", ".join(words + ([] if sinks is None else ["sinks"]))


def _for_kind(meta: CPAttnMeta, kind: LayerKind) -> tuple[CPAttnMeta, LayerKind]:
    """The meta of the layer's kind (``CPAttnMeta.for_kind``) and what is left for the kernels to mask.

    The kind's meta splits shards at chunk boundaries, so the kernels see no chunk: a window or a soft-cap
    at most.
    """
    return meta.for_kind(window=kind.window, chunk=kind.chunk), LayerKind(window=kind.window, softcap=kind.softcap)


def _resolve(backend: str, q_THD: torch.Tensor, kind: LayerKind, sinks, ring: bool = False) -> str:
    # a layer kind or sinks run through the log-sum-exp entry points (layer_kinds.kind_attention)
    blockwise = ring or not kind.plain or sinks is not None
    return resolve_backend(backend, q_THD, blockwise=blockwise, **kind.kernel_args())


def _accumulating(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype its gradient is summed in (float32 or wider); the same tensor when it already is."""
    return x.to(lse_dtype(x.dtype))


def _check_group(meta: CPAttnMeta, group) -> None:
    if dist.get_world_size(group) != meta.cp or dist.get_rank(group) != meta.rank:
        raise ValueError(f"the meta is for rank {meta.rank} of {meta.cp}, but this process is rank "
                         f"{dist.get_rank(group)} of a group of {dist.get_world_size(group)}")


def pack_send(k_TKD: torch.Tensor, v_TKD: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Build this rank's collective input, (exchange.send_rows, 2, K, D): rows to send, then zero padding."""
    index = exchange.send_index
    send = torch.stack((k_TKD.index_select(0, index), v_TKD.index_select(0, index)), dim=1)
    padding = exchange.send_rows - send.shape[0]
    if padding:
        send = torch.cat((send, send.new_zeros((padding, *send.shape[1:]))))
    return send


def _attend(q_THD, k_SKD, v_SKD, part: QueryPart, kv_index: torch.Tensor, backend: str,
            softmax_scale: float | None, kind: LayerKind | None, sinks: torch.Tensor | None) -> torch.Tensor:
    if part.num_tokens == 0:
        # empty, but in the graph of q (and of the sinks): a rank holding no tokens still runs the backward
        return q_THD[:0] if sinks is None else q_THD[:0] + 0 * sinks.sum()
    # K/V may come in the accumulation dtype (float32): the kernel reads q's dtype, its dK/dV are summed wider
    k_SKD, v_SKD = (x.index_select(0, kv_index).to(q_THD.dtype) for x in (k_SKD, v_SKD))
    if (kind is not None and not kind.plain) or sinks is not None:
        return kind_attention(q_THD.index_select(0, part.q_index), k_SKD, v_SKD, part.cu_seqlens_q,
                              part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k, kind=kind or LayerKind(),
                              sinks_H=sinks, backend=backend, softmax_scale=softmax_scale)
    return varlen_attention(q_THD.index_select(0, part.q_index), k_SKD, v_SKD, part.cu_seqlens_q,
                            part.cu_seqlens_k, part.max_seqlen_q, part.max_seqlen_k, backend, softmax_scale)


def local_attention(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: CPAttnMeta,
                    backend: str = "auto", softmax_scale: float | None = None, kind: LayerKind | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Output of the local-only shards, (meta.local.num_tokens, H, D), in ``meta.local.q_index`` order.

    ``kind`` and ``sinks``: the layer's (``cp_attention``); ``backend`` must run them.
    """
    return _attend(q_THD, k_TKD, v_TKD, meta.local, meta.local_kv_index, backend, softmax_scale, kind, sinks)


def remote_attention(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, recv_RKD: torch.Tensor,
                     meta: CPAttnMeta, exchange: Exchange, backend: str = "auto",
                     softmax_scale: float | None = None, kind: LayerKind | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Output of the shards needing remote K/V, (meta.remote.num_tokens, H, D), given the receive buffer.

    ``recv_RKD`` is (exchange.recv_rows, 2, K, D): what ``exchange``'s collective delivered (K in ``[:, 0]``,
    V in ``[:, 1]``).
    """
    if meta.remote.num_tokens == 0:
        return q_THD[:0]
    k_SKD = torch.cat((k_TKD, recv_RKD[:, 0]))
    v_SKD = torch.cat((v_TKD, recv_RKD[:, 1]))
    return _attend(q_THD, k_SKD, v_SKD, meta.remote, exchange.kv_index, backend, softmax_scale, kind, sinks)


def attention_after_exchange(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                             recv_RKD: torch.Tensor, meta: CPAttnMeta, comm: str = "auto",
                             backend: str = "auto", softmax_scale: float | None = None,
                             kind: LayerKind | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Compute a rank's ``out_THD`` from the receive buffer its ``comm`` exchange would deliver.

    ``kind`` and ``sinks``: the layer's, as ``cp_attention``'s window, chunk, softcap and sinks.
    """
    meta, kind = _for_kind(meta, kind or LayerKind())
    comm = meta.resolve_comm(comm, k_TKD.element_size())
    meta = meta.to(q_THD.device, comm=comm)
    _check_inputs(q_THD, k_TKD, v_TKD, meta)
    check_sinks(sinks, q_THD.shape[1])
    exchange = meta.exchange(comm)
    backend = _resolve(backend, q_THD, kind, sinks)
    if recv_RKD.shape[0] != exchange.recv_rows:
        raise ValueError(f"the receive buffer has {recv_RKD.shape[0]} rows, the {exchange.mode} exchange "
                         f"delivers {exchange.recv_rows}")
    k_TKD, v_TKD = _accumulating(k_TKD), _accumulating(v_TKD)
    recv_RKD = recv_RKD.to(k_TKD.dtype)
    out_local = local_attention(q_THD, k_TKD, v_TKD, meta, backend, softmax_scale, kind, sinks)
    out_remote = remote_attention(q_THD, k_TKD, v_TKD, recv_RKD, meta, exchange, backend, softmax_scale, kind,
                                  sinks)
    return _combine(out_local, out_remote, meta)


def _combine(out_local: torch.Tensor, out_remote: torch.Tensor, meta: CPAttnMeta) -> torch.Tensor:
    if out_remote.shape[0] == 0:
        out = out_local
    elif out_local.shape[0] == 0:
        out = out_remote
    else:
        out = torch.cat((out_local, out_remote))
    return out.index_select(0, meta.out_index)


def _check_inputs(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: CPAttnMeta) -> None:
    if q_THD.dim() != 3 or k_TKD.dim() != 3 or k_TKD.shape != v_TKD.shape:
        raise ValueError(f"expected q (T, H, D) and k, v (T, K, D), got {tuple(q_THD.shape)}, "
                         f"{tuple(k_TKD.shape)}, {tuple(v_TKD.shape)}")
    if q_THD.shape[0] != meta.num_tokens or k_TKD.shape[0] != meta.num_tokens:
        raise ValueError(f"rank {meta.rank} holds {meta.num_tokens} tokens but q has {q_THD.shape[0]} and k "
                         f"{k_TKD.shape[0]}")
    if q_THD.shape[2] != k_TKD.shape[2] or q_THD.shape[1] % k_TKD.shape[1]:
        raise ValueError(f"q heads {q_THD.shape[1]} must be a multiple of k/v heads {k_TKD.shape[1]} and the "
                         f"head dims must match ({q_THD.shape[2]} vs {k_TKD.shape[2]})")
