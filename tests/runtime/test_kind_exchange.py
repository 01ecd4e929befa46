"""The exchange of each layer kind (``CPAttnMeta.for_kind``): what it moves, where its keys land, what it computes.

Token by token, from the definitions: a query at position p of its document sees, under a window W, the
positions ``(p - W, p]`` and, under a chunk K, ``[K*floor(p/K), p]``. A rank needs the keys its queries see
that it does not hold; the per-kind exchange must move exactly those (a2a), or every token some other rank
needs (the compacted all-gather), and each kernel sequence must read the keys of one document (or chunk) in
order, bottom-right aligned with its queries. Then the whole thing, emulated in one process over random plans
with documents split across ranks and pieces out of order, against float64 dense attention with the document
mask and the layer's mask.
"""

import numpy as np
import pytest
import torch

from flashcp.costmodel.comm import exchange_volumes
from flashcp.costmodel.workload import CHUNK, WINDOW
from flashcp.runtime.attention import attention_after_exchange
from flashcp.runtime.layer_kinds import LayerKind
from flashcp.runtime.meta import CPAttnMeta, build_rank_metas, rank_token_positions
from tests.emulate import emulate_exchange, random_plan
from tests.naive import naive_document_attention


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors of a few hundred tokens: torch's intra-op threads only contend (7x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


KINDS = ({"window": 1}, {"window": 3}, {"window": 7}, {"chunk": 2}, {"chunk": 5}, {"window": 3, "chunk": 4})


def _plans():
    """(cp, plan, doc_lens): random plans, documents split over ranks, pieces out of order, cp 2 to 4."""
    cases = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        cp = 2 + seed % 3
        doc_lens = rng.integers(1, 30, size=int(rng.integers(1, 6)))
        doc_lens = np.r_[doc_lens, cp] if doc_lens.sum() < cp else doc_lens
        plan = random_plan(doc_lens, cp, rng, max_pieces=(2, 4, 1000)[seed % 3], cut_prob=0.2)
        cases.append((cp, plan, doc_lens))
    return cases


def _sees(p_query: int, p_key: int, window=None, chunk=None) -> bool:
    """Whether a query at document position ``p_query`` sees the key at ``p_key`` (same document)."""
    if p_key > p_query or (window is not None and p_key <= p_query - window):
        return False
    return chunk is None or p_key // chunk == p_query // chunk


def _needed(plan, doc_lens, rank, kind) -> set[tuple[int, int]]:
    """(doc, position) of every key a query of ``rank`` sees under ``kind``, one query at a time."""
    _, doc_pos, doc = rank_token_positions(plan, doc_lens, rank)
    return {(int(d), p_key) for p_query, d in zip(doc_pos.tolist(), doc.tolist())
            for p_key in range(p_query + 1) if _sees(p_query, p_key, **kind)}


@pytest.mark.parametrize("kind", KINDS, ids=str)
def test_kind_exchange_moves_exactly_the_keys_each_rank_needs(kind):
    smaller = 0
    for cp, plan, doc_lens in _plans():
        held = [set(zip(*reversed(rank_token_positions(plan, doc_lens, r)[1:]))) for r in range(cp)]
        missing = [_needed(plan, doc_lens, r, kind) - held[r] for r in range(cp)]
        # the compacted all-gather: every token some other rank needs, the slot the largest contribution
        wanted = set().union(*missing)
        slot = max(len(wanted & held[r]) for r in range(cp))
        metas = [m.for_kind(**kind) for m in build_rank_metas(plan, doc_lens)]
        full = build_rank_metas(plan, doc_lens)
        for r, meta in enumerate(metas):
            sent = sum(len(missing[peer] & held[r]) for peer in range(cp))
            assert meta.wire_tokens("a2a") == (sent, len(missing[r])), (cp, r, kind)
            assert meta.wire_tokens("allgather") == ((cp - 1) * slot,) * 2, (cp, r, kind)
            assert meta.wire_tokens("full") == full[r].wire_tokens("full")
            assert meta.exchanges["a2a"].recv_splits == tuple(len(missing[r] & held[q]) for q in range(cp))
            assert meta.wire_tokens("a2a")[1] <= full[r].wire_tokens("a2a")[1]
            smaller += full[r].wire_tokens("a2a")[1] - meta.wire_tokens("a2a")[1]
        assert metas[0].a2a_busiest == max(max(m.wire_tokens("a2a")) for m in metas)
    assert smaller > 0, f"{kind} never moved less than full causal attention"


@pytest.mark.parametrize("kind", KINDS, ids=str)
@pytest.mark.parametrize("comm", ["allgather", "a2a", "full"])
def test_each_kernel_sequence_reads_its_document_keys_bottom_right_aligned(kind, comm):
    window, chunk = kind.get("window"), kind.get("chunk")
    for cp, plan, doc_lens in _plans():
        doc_start = np.r_[0, np.cumsum(doc_lens)[:-1]]
        metas = [m.for_kind(**kind) for m in build_rank_metas(plan, doc_lens)]
        positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, r)[0]) for r in range(cp)]
        # keys and values carry their packed position: what the kernel reads says where it came from
        keys = [p.double()[:, None, None] for p in positions]
        recvs = emulate_exchange(metas, keys, keys, comm)
        for r, meta in enumerate(metas):
            exchange = meta.exchange(comm)
            for part, source in ((meta.local, keys[r][:, 0, 0]),
                                 (meta.remote, torch.cat((keys[r], recvs[r][:, 0]))[:, 0, 0])):
                got_k = source[exchange.kv_index if part is meta.remote else meta.local_kv_index].long().tolist()
                got_q = positions[r][part.q_index].tolist()
                cu_q, cu_k = part.cu_seqlens_q.tolist(), part.cu_seqlens_k.tolist()
                for s in range(len(cu_q) - 1):
                    q_pos, k_pos = got_q[cu_q[s]:cu_q[s + 1]], got_k[cu_k[s]:cu_k[s + 1]]
                    first = int(doc_start[np.searchsorted(doc_start, q_pos[0], side="right") - 1])
                    low = first if window is None else max(first, q_pos[0] - window + 1)
                    if chunk is not None:  # one chunk per sequence
                        low = max(low, first + (q_pos[0] - first) // chunk * chunk)
                        assert (q_pos[-1] - first) // chunk == (q_pos[0] - first) // chunk
                    assert k_pos == list(range(low, q_pos[-1] + 1)), (cp, r, comm, s, q_pos, k_pos)
                    assert q_pos == list(range(q_pos[0], q_pos[-1] + 1))
                    assert part.max_seqlen_q >= len(q_pos) and part.max_seqlen_k >= len(k_pos)


@pytest.mark.parametrize("comm", ["allgather", "a2a", "full"])
def test_per_kind_exchange_equals_dense_reference_forward_and_backward(comm):
    """Every rank emulated in one process (the exchange differentiable), float64, GQA and MQA."""
    failures = []
    for index, (cp, plan, doc_lens) in enumerate(_plans()):
        num_heads, num_kv_heads = 4, (2, 1)[index % 2]
        context_len = int(np.sum(doc_lens))
        gen = torch.Generator().manual_seed(index)
        q, k, v, grad = (torch.randn(context_len, h, 8, dtype=torch.float64, generator=gen)
                         for h in (num_heads, num_kv_heads, num_kv_heads, num_heads))
        sinks = torch.randn(num_heads, dtype=torch.float64, generator=gen)
        positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, r)[0]) for r in range(cp)]
        metas = build_rank_metas(plan, doc_lens)
        for kind in (*KINDS, {"window": 5, "sinks": True}, {"window": 4, "softcap": 2.0}, {"chunk": 3, "sinks": True}):
            layer = {name: value for name, value in kind.items() if name != "sinks"}
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            used_sinks = leaves[3] if kind.get("sinks") else None
            ref = naive_document_attention(*leaves[:3], doc_lens, scale=0.3, sinks=used_sinks, **layer)
            ref_grads = torch.autograd.grad(ref, leaves, grad, allow_unused=True)
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            used_sinks = leaves[3] if kind.get("sinks") else None
            ks, vs = [leaves[1][p] for p in positions], [leaves[2][p] for p in positions]
            kind_metas = [m.for_kind(window=layer.get("window"), chunk=layer.get("chunk")) for m in metas]
            recvs = emulate_exchange(kind_metas, ks, vs, comm)
            out = torch.zeros_like(ref)
            for r, meta in enumerate(metas):
                out_r = attention_after_exchange(leaves[0][positions[r]], ks[r], vs[r], recvs[r], meta, comm,
                                                 softmax_scale=0.3, kind=LayerKind(**layer), sinks=used_sinks)
                out = out.index_put((positions[r],), out_r)
            grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
            errors = [(out - ref).abs().max().item()] + [
                0.0 if want is None else float("inf") if got is None else (got - want).abs().max().item()
                for got, want in zip(grads, ref_grads)]
            if max(errors) > 1e-10:
                failures.append(f"cp={cp} plan {index} K={num_kv_heads} {kind} {comm}: max |err| out, dq, dk, dv, "
                                f"dsinks = {errors}")
    assert not failures, "\n".join(failures)


def test_for_kind_is_cached_and_refuses_nonsense():
    doc_lens = np.array([9, 4])
    meta = CPAttnMeta.from_plan(random_plan(doc_lens, 2, np.random.default_rng(0)), doc_lens, 0)
    assert meta.for_kind() is meta
    windowed = meta.for_kind(window=3)
    assert meta.for_kind(window=3) is windowed
    assert meta.for_kind(chunk=4, window=2) is not meta.for_kind(chunk=4)
    assert meta.to("cpu", comm="a2a").for_kind(window=3) is windowed
    with pytest.raises(ValueError, match="window and chunk must be positive"):
        meta.for_kind(window=0)


@pytest.mark.parametrize("kind", [k for k in KINDS if len(k) == 1], ids=str)
def test_the_planner_prices_what_the_kind_exchange_moves(kind):
    """The cost model's exact-need and all-gather volumes of a kind (what flashcp2 plans with) are the
    runtime's: each rank's a2a sent and received, and the all-gather slot."""
    (name, size), = kind.items()
    code = {"window": WINDOW, "chunk": CHUNK}[name]
    for cp, plan, doc_lens in _plans():
        volumes = exchange_volumes(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp,
                                   kind=code, size=size)
        metas = [m.for_kind(**kind) for m in build_rank_metas(plan, doc_lens)]
        for r, meta in enumerate(metas):
            assert meta.wire_tokens("a2a") == (volumes.sent[r], volumes.received[r]), (cp, r, kind)
            assert meta.wire_tokens("allgather")[0] == (cp - 1) * volumes.contributed.max(), (cp, r, kind)
