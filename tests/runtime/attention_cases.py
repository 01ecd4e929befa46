"""The CP attention cases every distributed attention test runs: random and strategy plans on small sequences."""

from __future__ import annotations

import numpy as np

from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies.baselines import ring_plan
from tests.emulate import random_plan
from tests.plans import llama3_like_plan, perdoc_like_plan, whole_docs_case

HEADS = ((4, 2), (4, 4), (4, 1))  # GQA, MHA, MQA


def build_cases(world_size: int) -> list[tuple[str, object, np.ndarray, int, int]]:
    """(name, plan, doc_lens, H, K): identical on every rank."""
    rng = np.random.default_rng(1000 + world_size)
    cases = []
    for i, max_pieces in enumerate((1, 2, 4, 1000, 3, 1000)):
        doc_lens = rng.integers(1, 13, size=int(rng.integers(1, 6)))
        doc_lens = np.r_[doc_lens, world_size] if doc_lens.sum() < world_size else doc_lens
        plan = random_plan(doc_lens, world_size, rng, max_pieces=max_pieces, cut_prob=0.25)
        cases.append((f"random{i}", plan, doc_lens, *HEADS[i % 3]))
    doc_lens = np.array([5 * world_size + 1])  # one document spread over every rank, length-1 shards likely
    cases.append(("one-doc", random_plan(doc_lens, world_size, rng, max_pieces=1000), doc_lens, 4, 2))
    doc_lens = rng.integers(1, 15, size=5)
    cases.append(("llama3", llama3_like_plan(doc_lens, world_size), doc_lens, 4, 2))
    doc_lens = 2 * world_size * rng.integers(1, 3, size=3)
    cases.append(("perdoc", perdoc_like_plan(doc_lens, world_size), doc_lens, 4, 4))
    doc_lens, plan = whole_docs_case(7 * world_size, world_size, rng)
    cases.append(("whole-docs", plan, doc_lens, 4, 2))
    doc_lens = np.r_[rng.integers(1, 9, size=4), 1]
    doc_lens = np.r_[doc_lens, world_size - doc_lens.sum() % world_size]  # C % N == 0: exactly (N-1)/N
    cases.append(("ring-layout", ring_plan(doc_lens, world_size), doc_lens, 4, 1))
    for name in ("llama3", "perdoc", "flashcp", "flashcp+"):  # the real strategies on a mixed sequence
        doc_lens = np.r_[rng.integers(1, 8, size=5), rng.integers(10 * world_size, 20 * world_size)]
        cases.append((f"strategy-{name}", plan_sequence(name, doc_lens, world_size), doc_lens, 4, 2))
    if world_size > 2:  # fewer tokens than ranks: the last ranks hold nothing, yet take part in every step
        doc_lens = np.array([1, world_size - 2])
        cases.append(("empty-ranks", ring_plan(doc_lens, world_size), doc_lens, 4, 2))
    return cases


def max_abs(got, want) -> float:
    """Max |got - want|; 0 for an empty slice (a rank with no tokens), inf for a missing gradient."""
    if want.numel() == 0:
        return 0.0
    return float("inf") if got is None else (got - want).abs().max().item()
