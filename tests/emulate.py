"""Single-process emulation of a CP step: every rank's exchange and attention without a process group.

Used by the tests (the meta's send and receive sides must agree) and by ``scripts/gpu_check.py`` (time one
rank's attention over the K/V it would hold after the exchange, all ranks on one device). Also holds a
random valid-plan generator for checks that want harsher plans than any strategy makes.
"""

from __future__ import annotations

import numpy as np
import torch

from flashcp.costmodel.workload import token_quotas
from flashcp.planner.plan import SequencePlan
from flashcp.runtime.attention import attention_after_exchange, pack_send
from flashcp.runtime.kernels import fold_softmax_scale, resolve_backend
from flashcp.runtime.meta import CPAttnMeta, build_rank_metas, rank_token_positions
from flashcp.runtime.ring import ring_attention_from_blocks

__all__ = ["emulate_cp_attention", "emulate_exchange", "random_plan"]


def emulate_exchange(metas: list[CPAttnMeta], ks: list[torch.Tensor], vs: list[torch.Tensor],
                     comm: str) -> list[torch.Tensor]:
    """The receive buffer each rank's ``comm`` collective would deliver, (recv_rows, 2, K, D) per rank.

    ``ks[r]`` / ``vs[r]`` are rank r's (T_r, K, D) keys / values. Follows the collectives' semantics: an
    all-gather concatenates every rank's send buffer in rank order; ``all_to_all_single`` gives rank r, from
    each source q in order, the slice of q's send buffer that q's ``send_splits`` address to r.
    """
    comm = metas[0].resolve_comm(comm, ks[0].element_size())
    sends = [pack_send(k, v, m.exchange(comm)) for m, k, v in zip(metas, ks, vs)]
    mode = metas[0].exchange(comm).mode
    if mode != "a2a":
        gathered = torch.cat(sends)
        return [gathered for _ in metas]
    chunks = [torch.split(send, list(m.exchanges["a2a"].send_splits)) for m, send in zip(metas, sends)]
    return [torch.cat([chunks[q][r] for q in range(len(metas))]) for r in range(len(metas))]


def emulate_cp_attention(q_CHD: torch.Tensor, k_CKD: torch.Tensor, v_CKD: torch.Tensor, plan: SequencePlan,
                         doc_lens, comm: str = "auto", backend: str = "auto",
                         softmax_scale: float | None = None) -> torch.Tensor:
    """Run every rank of ``plan`` in this process and return the packed sequence's output, (C, H, D).

    Takes the whole sequence's q/k/v in packed order; differentiable (autograd follows the emulated exchange).
    With ``comm="ring"`` each rank's steps run over the other ranks' blocks directly.
    """
    metas = build_rank_metas(plan, doc_lens)
    positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, r)[0]).to(q_CHD.device)
                 for r in range(plan.cp)]
    ks = [k_CKD[p] for p in positions]
    vs = [v_CKD[p] for p in positions]
    out = q_CHD.new_zeros(q_CHD.shape)
    comm = metas[0].resolve_comm(comm, k_CKD.element_size())
    if comm == "ring":
        backend = resolve_backend(backend, q_CHD, blockwise=True)
        blocks = [torch.stack((k, v)) for k, v in zip(ks, vs)]
        for r, meta in enumerate(metas):
            ring = meta.to(q_CHD.device, comm="ring").ring
            q_r = fold_softmax_scale(q_CHD[positions[r]], softmax_scale)
            out_r = ring_attention_from_blocks(q_r, blocks, ring, backend)
            out = out.index_put((positions[r],), out_r)
        return out
    recvs = emulate_exchange(metas, ks, vs, comm)
    for r, meta in enumerate(metas):
        out_r = attention_after_exchange(q_CHD[positions[r]], ks[r], vs[r], recvs[r], meta, comm, backend,
                                         softmax_scale)
        out = out.index_put((positions[r],), out_r)
    return out


def random_plan(doc_lens, cp: int, rng: np.random.Generator, max_pieces: int = 4,
                cut_prob: float = 0.1) -> SequencePlan:
    """A random valid plan: equal-token quotas, documents spread over ranks, length-1 shards likely.

    Each rank's quota is cut into up to ``max_pieces`` random pieces, all pieces are shuffled and laid along
    the packed sequence; shards are the runs of one rank inside one document, each further cut with
    probability ``cut_prob`` per token boundary (so a rank may hold adjacent shards of one document). Rows
    come in random order.
    """
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    context_len = int(doc_lens.sum())
    pieces = []
    for rank, quota in enumerate(token_quotas(context_len, cp)):
        if quota == 0:
            continue
        num = int(rng.integers(1, min(max_pieces, quota) + 1))
        cuts = np.sort(rng.choice(np.arange(1, quota), size=num - 1, replace=False))
        pieces += [(rank, int(size)) for size in np.diff(np.r_[0, cuts, quota])]
    order = rng.permutation(len(pieces))
    owner = np.concatenate([np.full(pieces[i][1], pieces[i][0], dtype=np.int64) for i in order])
    doc = np.repeat(np.arange(doc_lens.size), doc_lens)
    pos = np.arange(context_len) - np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
    new_shard = np.r_[True, (owner[1:] != owner[:-1]) | (doc[1:] != doc[:-1])
                      | (rng.random(context_len - 1) < cut_prob)]
    first = np.flatnonzero(new_shard)
    lengths = np.diff(np.r_[first, context_len])
    rows = rng.permutation(first.size)
    return SequencePlan.from_arrays(doc[first][rows], pos[first][rows], lengths[rows], owner[first][rows], cp)
