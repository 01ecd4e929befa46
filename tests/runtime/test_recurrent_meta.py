"""RecurrentMeta from plans, checked without ranks: the routes emulated on one process (every rank packs its
send buffer, the buffers are split and delivered as ``all_to_all_single`` delivers them) must hand each piece
its predecessors' maps in document order and the ``W - 1`` inputs before it."""

import numpy as np
import pytest
import torch

from flashcp.runtime.meta import rank_token_positions
from flashcp.runtime.recurrent import RecurrentMeta
from tests.emulate import random_plan
from tests.plans import whole_docs_case


def plans(cp: int):
    rng = np.random.default_rng(300 + cp)
    for max_pieces in (1, 2, 4, 1000):
        doc_lens = rng.integers(1, 12, size=int(rng.integers(1, 6)))
        doc_lens = np.r_[doc_lens, cp] if doc_lens.sum() < cp else doc_lens
        yield random_plan(doc_lens, cp, rng, max_pieces=max_pieces, cut_prob=0.3), doc_lens
    yield random_plan(np.array([4 * cp + 1]), cp, rng, max_pieces=1000, cut_prob=0.5), np.array([4 * cp + 1])


def deliver(routes, local_rows):
    """What each rank reads, ``cat(local rows, receive buffer[, zero row])[read_index]``, after an emulated
    all-to-all of ``routes`` (one per rank) over ``local_rows`` (one tensor per rank)."""
    cp = len(routes)
    pieces = [list(rows[torch.from_numpy(route.send_index)].split(list(route.send_splits)))
              for route, rows in zip(routes, local_rows)]
    read = []
    for rank, (route, rows) in enumerate(zip(routes, local_rows)):
        received = [pieces[sender][rank] for sender in range(cp)]
        assert [len(r) for r in received] == list(route.recv_splits)
        pool = torch.cat([rows, *received, rows.new_zeros(1, *rows.shape[1:])])
        read.append(pool[torch.from_numpy(route.read_index)])
    return read


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_piece_reads_its_predecessors_maps_in_document_order(cp):
    """A contributed shard's "map" is its plan row; every piece must read the rows of the shards before it."""
    for plan, doc_lens in plans(cp):
        metas = [RecurrentMeta.from_plan(plan, doc_lens, rank) for rank in range(cp)]
        local = [torch.from_numpy(plan.rank_slice(rank)[meta.contributes])[:, None]
                 for rank, meta in enumerate(metas)]
        read = deliver([meta.maps for meta in metas], local)
        for rank, meta in enumerate(metas):
            mine = plan.rank_slice(rank).tolist()
            assert meta.num_tokens == int(plan.shard_len[mine].sum())
            for piece, shard in enumerate(mine):
                before = sorted((plan.shard_start[i], i) for i in range(plan.num_shards)
                                if plan.shard_doc[i] == plan.shard_doc[shard]
                                and plan.shard_start[i] < plan.shard_start[shard])
                got = read[rank][meta.pred_ptr[piece]:meta.pred_ptr[piece + 1], 0].tolist()
                assert got == [i for _, i in before], (rank, piece)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_no_map_is_sent_twice_to_a_rank_or_to_its_own_rank(cp):
    """Each contributed shard's map goes once to each other rank holding a later shard of its document."""
    for plan, doc_lens in plans(cp):
        for rank in range(cp):
            meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
            mapped = plan.rank_slice(rank)[meta.contributes]
            assert meta.maps.send_splits[rank] == 0 and meta.maps.recv_splits[rank] == 0
            bounds = np.cumsum([0, *meta.maps.send_splits])
            for peer in range(cp):
                sent = mapped[meta.maps.send_index[bounds[peer]:bounds[peer + 1]]].tolist()
                want = [i for i in mapped if peer != rank and any(
                    plan.shard_rank[j] == peer and plan.shard_start[j] > plan.shard_start[i]
                    for j in np.flatnonzero(plan.shard_doc == plan.shard_doc[i]))]
                assert sent == want, (rank, peer)


def test_whole_documents_exchange_nothing():
    doc_lens, plan = whole_docs_case(20, 3, np.random.default_rng(0))
    for rank in range(3):
        meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
        assert not meta.active and not meta.contributes.any() and meta.maps.read_index.size == 0
        assert not meta.maps.active and not meta.conv_tails(4).active


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("width", [2, 4, 6])
def test_conv_tails_are_the_inputs_before_each_piece(cp, width):
    """Each piece's tail must be the ``width - 1`` inputs before it in its document (zeros before the start),
    and no rank receives a token twice or a token it holds."""
    for plan, doc_lens in plans(cp):
        metas = [RecurrentMeta.from_plan(plan, doc_lens, rank) for rank in range(cp)]
        if not metas[0].active:
            continue
        x = torch.arange(1, int(doc_lens.sum()) + 1, dtype=torch.float64)[:, None]  # token i holds i + 1
        doc_start = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
        positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0]) for rank in range(cp)]
        routes = [meta.conv_tails(width) for meta in metas]
        for rank, route in enumerate(routes):
            bounds = np.cumsum([0, *route.send_splits])
            for peer in range(cp):
                sent = positions[rank][route.send_index[bounds[peer]:bounds[peer + 1]]]
                assert len(set(sent.tolist())) == len(sent) and not set(sent.tolist()) & set(positions[peer].tolist())
        read = deliver(routes, [x[pos] for pos in positions])
        for meta, pos, got in zip(metas, positions, read):
            tails = got.view(meta.num_pieces, width - 1)
            for piece, first in enumerate(meta.cu_seqlens[:-1]):
                token = int(pos[first])
                want = [t + 1.0 if t >= doc_start[token] else 0.0 for t in range(token - width + 1, token)]
                assert tails[piece].tolist() == want, (meta.rank, piece, tails[piece].tolist(), want)


def test_refusals_name_what_was_got():
    from flashcp.runtime.recurrent import chunk_gated_delta_rule, chunk_ssd, cp_causal_conv1d, cp_ssd

    plan = random_plan(np.array([5, 4]), 2, np.random.default_rng(1), max_pieces=2)
    meta = RecurrentMeta.from_plan(plan, np.array([5, 4]), 0)
    x = torch.zeros(meta.num_tokens + 1, 3)
    with pytest.raises(ValueError, match=f"rank 0 holds {meta.num_tokens} tokens but the inputs have"):
        cp_causal_conv1d(x, torch.zeros(3, 4), None, meta)
    with pytest.raises(ValueError, match="rank 0 holds"):
        cp_ssd(x[:, None], x[:, :1], torch.zeros(1), x[:, None], x[:, None], meta)
    with pytest.raises(ValueError, match="rank 5 is outside"):
        RecurrentMeta.from_plan(plan, np.array([5, 4]), 5)
    q = torch.zeros(6, 3, 4)
    with pytest.raises(ValueError, match="H % Hk == 0"):
        chunk_gated_delta_rule(q, q, torch.zeros(6, 4, 2), torch.zeros(6, 4), torch.zeros(6, 4), [0, 6])
    with pytest.raises(ValueError, match="the initial state has shape"):
        chunk_ssd(torch.zeros(6, 2, 3), torch.zeros(6, 2), torch.zeros(2), torch.zeros(6, 1, 4),
                  torch.zeros(6, 1, 4), [0, 6], torch.zeros(2, 2, 3, 4))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        chunk_ssd(torch.zeros(6, 2, 3), torch.zeros(6, 2), torch.zeros(2), torch.zeros(6, 1, 4),
                  torch.zeros(6, 1, 4), [1, 6])
    with pytest.raises(ValueError, match="cu_seqlens ends at 5, but the inputs have 6 tokens"):
        chunk_ssd(torch.zeros(6, 2, 3), torch.zeros(6, 2), torch.zeros(2), torch.zeros(6, 1, 4),
                  torch.zeros(6, 1, 4), [0, 5])
