"""``CPAttention`` (flashcp.runtime.module): cp_attention bound to a batch's meta, the call a model makes."""

import numpy as np
import torch

from flashcp.runtime import CommStats, CPAttention, cp_attention
from flashcp.runtime.meta import build_rank_metas, rank_token_positions
from tests.naive import naive_document_attention
from tests.plans import whole_docs_case
from tests.runtime import TOL, qkv


def test_a_bound_call_is_cp_attention_with_its_settings():
    """On a plan where every document is whole on its rank nothing moves, so each rank runs alone."""
    doc_lens, plan = whole_docs_case(40, 2, np.random.default_rng(3))
    q, k, v = qkv(int(doc_lens.sum()), 4, 2)
    ref = naive_document_attention(q, k, v, doc_lens)
    for meta in build_rank_metas(plan, doc_lens):
        pos = torch.from_numpy(rank_token_positions(plan, doc_lens, meta.rank)[0])
        stats = CommStats()
        attn = CPAttention(meta=meta, comm="a2a", backend="reference", stats=stats)
        out = attn(q[pos], k[pos], v[pos])
        assert (out - ref[pos]).abs().max().item() < TOL
        same = cp_attention(q[pos], k[pos], v[pos], meta, comm="a2a", backend="reference")
        assert torch.equal(out, same) and not stats.records  # nothing needed from the other rank
        scaled = attn(q[pos], k[pos], v[pos], softmax_scale=0.5)
        assert (scaled - naive_document_attention(q, k, v, doc_lens, scale=0.5)[pos]).abs().max().item() < TOL
