"""The peers' kernels (magi, ptrr) against the plain-Python references, by hand and against torch's own scheduler."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies.peers import ptrr_process_times
from tests.naive import (
    naive_magi,
    naive_ptrr,
    naive_ptrr_times,
)
from tests.plans import as_tuples, examples, sequences


@examples(120)
@given(case=sequences(max_len=400), chunk=st.integers(1, 96))
def test_peers_equal_references(case, chunk):
    lens, cp = case
    for name, reference in (("magi", naive_magi), ("ptrr", naive_ptrr)):
        plan = plan_sequence(name, lens, cp, chunk_size=chunk)
        assert as_tuples(plan) == reference(lens, cp, chunk), f"{name} cp={cp} chunk={chunk} lens={lens}"
        plan.validate(lens)


def test_magi_by_hand():
    # one document of 8 tokens, chunks of 2: workloads 3, 7, 11, 15. Largest first to the least-loaded
    # rank with room: 15 -> rank 0, 11 -> rank 1, 7 -> rank 1 (11 < 15), 3 -> rank 0 (15 < 18)
    plan = plan_sequence("magi", [8], 2, chunk_size=2)
    assert as_tuples(plan) == [(0, 0, 2, 0), (0, 6, 2, 0), (0, 2, 4, 1)]
    # equal workloads: the later chunk first (two documents of 2 tokens, chunks of 2, cp 2)
    assert as_tuples(plan_sequence("magi", [2, 2], 2, chunk_size=2)) == [(1, 0, 2, 0), (0, 0, 2, 1)]


def test_ptrr_times_and_dealing_match_torch():
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer

    # torch's own docstring example: 16 tasks over 4 groups
    times = torch.tensor([9, 14, 2, 20, 10, 15, 8, 14, 16, 19, 15, 3, 12, 1, 12, 10])
    groups = _PTRRLoadBalancer.ptrr_scheduling(times, 4).tolist()
    lens = [1] * 16  # 16 blocks of one token: rank of block i from our dealing rule
    order = sorted(range(16), key=lambda i: -int(times[i]))
    ours = [[] for _ in range(4)]
    for p, i in enumerate(order):
        ours[p % 4 if (p // 4) % 2 == 0 else 3 - p % 4].append(i)
    assert [sorted(g) for g in ours] == groups
    assert naive_ptrr_times([5, 11, 3, 13], 4) == ptrr_process_times(np.array([5, 11, 3, 13]), 4).tolist()
    del lens


def test_ptrr_equals_torch_load_balancer():
    torch = pytest.importorskip("torch")
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer
    from torch.nn.attention.flex_attention import create_block_mask

    lens, cp = [300, 1000, 50, 700, 2046], 4  # 4096 tokens = 32 blocks of 128, 8 per rank
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))

    def document_causal(b, h, q, k):
        return (doc[q] == doc[k]) & (k <= q)

    mask = create_block_mask(document_causal, 1, 1, sum(lens), sum(lens), device="cpu")
    indices = _PTRRLoadBalancer(mask, cp)._generate_indices()[0].numpy()
    per_rank = sum(lens) // cp
    plan = plan_sequence("ptrr", lens, cp)
    starts = np.r_[0, np.cumsum(lens)]
    for rank in range(cp):
        ours = sorted(t for d, s, n, r in as_tuples(plan) if r == rank
                      for t in range(starts[d] + s, starts[d] + s + n))
        assert ours == sorted(indices[rank * per_rank:(rank + 1) * per_rank].tolist())
