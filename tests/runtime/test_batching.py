"""Several packed sequences run as one (flashcp.runtime.batching): each rank's tokens are its loader batches
concatenated, and attention over the combined plan equals each sequence's document attention (float64)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from flashcp.runtime.batching import concat_batches, concat_plans
from flashcp.runtime.loader import CPLoader
from flashcp.runtime.meta import rank_token_positions
from tests.emulate import emulate_cp_attention, random_plan
from tests.equivalence import planned_dataset
from tests.naive import naive_document_attention
from tests.plans import random_rows
from tests.runtime import TOL, qkv

CONTEXT = 64


@pytest.mark.parametrize("cp", [2, 3])
def test_combined_plan_keeps_attention_inside_each_sequence(cp):
    rng = np.random.default_rng(cp)
    doc_lens = random_rows(rng, 3, CONTEXT, (1, 6))
    plans = [random_plan(lens, cp, rng) for lens in doc_lens]
    plan, lens = concat_plans(plans, doc_lens)
    # rank r's tokens of the combined sequence are its tokens of sequence 0, then of sequence 1, ...
    for r in range(cp):
        expected = np.concatenate([rank_token_positions(p, n, r)[0] + i * CONTEXT
                                   for i, (p, n) in enumerate(zip(plans, doc_lens))])
        np.testing.assert_array_equal(rank_token_positions(plan, lens, r)[0], expected)
    q, k, v = qkv(3 * CONTEXT, 4, 2)
    for comm in ("allgather", "a2a", "ring"):
        out = emulate_cp_attention(q, k, v, plan, lens, comm=comm, backend="reference")
        want = torch.cat([naive_document_attention(q[i * CONTEXT:(i + 1) * CONTEXT], k[i * CONTEXT:(i + 1) * CONTEXT],
                                                   v[i * CONTEXT:(i + 1) * CONTEXT], n)
                          for i, n in enumerate(doc_lens)])
        err = (out - want).abs()
        assert err.max().item() < TOL, f"cp {cp} {comm}: max err {err.max().item():.2e}, mean {err.mean().item():.2e}"


def test_concat_batches_joins_one_ranks_loader_batches(tmp_path):
    from functools import partial

    from flashcp.planner.planning import plan_sequence

    sequences = planned_dataset(tmp_path, CONTEXT, {"cp2": (partial(plan_sequence, "flashcp"), 2)}, seed=3,
                                num_seqs=4, cuts=(2, 6), vocab_size=64)
    rows = [doc_lens for _, doc_lens in sequences]
    rng = np.random.default_rng(3)
    for rank in range(2):
        batches = list(CPLoader(tmp_path, "cp2", rank, 2, shuffle=False))
        joined = concat_batches(batches[:3])
        for name in ("input_ids", "position_ids", "labels"):
            assert torch.equal(getattr(joined, name), torch.cat([getattr(b, name) for b in batches[:3]])), name
        assert joined.num_label_tokens == sum(b.num_label_tokens for b in batches[:3])
        assert joined.attn.rank == rank and joined.attn.num_tokens == joined.input_ids.numel()
        assert concat_batches(batches[:1]) is batches[0]
    rank0, rank1 = (next(iter(CPLoader(tmp_path, "cp2", rank, 2, shuffle=False))) for rank in range(2))
    for batches, message in [([], "needs at least one batch"),
                             ([rank0, rank1], r"got batches of ranks \[0, 1\]"),
                             ([rank0, replace(rank0, plan=None)], "a batch has no plan or doc_lens; take the batches "
                                                                  "from CPLoader")]:
        with pytest.raises(ValueError, match=message) as refused:
            concat_batches(batches)
        assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"planned for one cp, got plans for cp \[2, 3\]"):
        concat_plans([random_plan(rows[0], 2, rng), random_plan(rows[1], 3, rng)], rows[:2])
