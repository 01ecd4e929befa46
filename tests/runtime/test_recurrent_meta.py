"""RecurrentMeta from plans, checked without ranks: predecessors and slots against a plain recount, and the
convolution tails by emulating the all-gather on one process."""

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


def naive_layout(plan):
    """(slot, row of each contributing shard) recounted shard by shard."""
    shards = list(zip(plan.shard_doc.tolist(), plan.shard_start.tolist(), plan.shard_rank.tolist()))
    last = {d: max(s for dd, s, _ in shards if dd == d) for d, _, _ in shards}
    count = {d: sum(dd == d for dd, _, _ in shards) for d, _, _ in shards}
    contributes = [count[d] > 1 and s < last[d] for d, s, _ in shards]
    per_rank = [sum(c for c, (_, _, r) in zip(contributes, shards) if r == rank) for rank in range(plan.cp)]
    slot = max(per_rank)
    row, seen = {}, [0] * plan.cp
    for i, (c, (_, _, r)) in enumerate(zip(contributes, shards)):
        if c:
            row[i] = r * slot + seen[r]
            seen[r] += 1
    return slot, row


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_predecessors_and_slots_equal_a_recount(cp):
    for plan, doc_lens in plans(cp):
        slot, row = naive_layout(plan)
        for rank in range(cp):
            meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
            assert meta.slot == slot and meta.active == (slot > 0)
            mine = plan.rank_slice(rank).tolist()
            assert meta.num_tokens == int(plan.shard_len[mine].sum())
            for piece, shard in enumerate(mine):
                before = sorted((plan.shard_start[i], i) for i in range(plan.num_shards)
                                if plan.shard_doc[i] == plan.shard_doc[shard]
                                and plan.shard_start[i] < plan.shard_start[shard])
                assert meta.predecessors(piece).tolist() == [row[i] for _, i in before], (rank, piece)


def test_whole_documents_exchange_nothing():
    doc_lens, plan = whole_docs_case(20, 3, np.random.default_rng(0))
    for rank in range(3):
        meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
        assert not meta.active and not meta.contributes.any() and meta.pred_row.size == 0


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("width", [2, 4, 6])
def test_conv_tails_are_the_inputs_before_each_piece(cp, width):
    """Every rank packs its send buffer, the buffers are stacked as an all-gather stacks them, and each
    piece's tail must be the ``width - 1`` inputs before it in its document (zeros before the start)."""
    for plan, doc_lens in plans(cp):
        metas = [RecurrentMeta.from_plan(plan, doc_lens, rank) for rank in range(cp)]
        if not metas[0].active:
            continue
        x = torch.arange(1, int(doc_lens.sum()) + 1, dtype=torch.float64)[:, None]  # token i holds i + 1
        doc_start = np.repeat(np.cumsum(doc_lens) - doc_lens, doc_lens)
        positions = [torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0]) for rank in range(cp)]
        sent = []
        for meta, pos in zip(metas, positions):
            local = torch.cat((x[pos], x.new_zeros(1, 1)))
            sent.append(local[meta.conv_tails(width)[0]])
        gathered = torch.cat(sent + [x.new_zeros(1, 1)])
        for meta, pos in zip(metas, positions):
            tails = gathered[meta.conv_tails(width)[1]].view(meta.num_pieces, width - 1)
            for piece, first in enumerate(meta.cu_seqlens[:-1]):
                if meta.piece_len[piece] == 0:
                    continue
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
