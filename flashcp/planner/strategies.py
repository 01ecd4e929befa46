"""Sharding strategies: the registry, the per-sequence wrappers and the rules each one follows.

Every strategy maps one packed sequence's document lengths ``doc_lens`` (num_docs,) and a CP size ``cp`` to
a :class:`~flashcp.planner.plan.SequencePlan` whose shards are sorted by (rank, doc, start), never contain
two touching shards of one document on one rank (they are merged), and give every rank its equal-token quota
(``C // N``, the first ``C % N`` ranks one more). The hot loops are Numba kernels in ``_kernels.py`` and
``_plus.py``; ``tests/naive.py`` re-implements every rule below in plain Python and the tests require
identical plans.

``llama3``
    The sequence is cut into 2N consecutive chunks; rank i gets chunks i and 2N-1-i. Chunk i holds
    ``q_i // 2`` tokens and chunk 2N-1-i the other ``q_i - q_i // 2``, so quotas hold for any C.

``perdoc``
    Every document of length d is cut into 2N chunks of ``d // 2N`` tokens; rank i gets chunks i and
    2N-1-i. The ``d % 2N`` remaining tokens of each document are dealt one at a time to ranks in round-robin
    order, with one pointer that starts at rank 0 and runs on across the documents of the sequence; a rank's
    first extra token of a document lengthens its early chunk, a second one its late chunk. Because the
    pointer never resets, the extras of the whole sequence reach rank i exactly ``E // N + [i < E % N]``
    times, which is what the quotas need (``C = 2N * sum(d // 2N) + E``). Documents shorter than 2N simply
    have empty chunks.

``flashcp`` (the paper's Algorithm 1, parameter ``target_imbalance`` R, default 1.05)
    Documents are sorted by decreasing length (ties: lower index). With the first k of them set aside for
    Per-Doc sharding (k = 0, 1, 2, ...), a temporary plan is built and its imbalance checked; the first k
    whose plan is within R (or k = all documents) wins. Choices the paper leaves open:

    - Per-Doc documents are cut with the ``perdoc`` rule above, dealt in document order; their chunks give
      each rank its starting workload and tokens (never more than its quota).
    - "Least-loaded worker" is the rank with the least attention workload so far (ties: lowest rank).
      Each rank keeps its pieces on a stack in the order it received them.
    - Whole-Doc sharding, while a rank holds more tokens than its quota: the rank with the largest excess
      (ties: lowest rank) pops the piece it received last (its shortest whole document, as documents arrive
      longest first) and the head of that piece, ``min(excess, deficit, piece length)`` tokens, moves to
      the under-filled rank with the least workload (ties: lowest rank), onto that rank's stack. A piece
      moved entirely is a whole document changing rank (no communication); otherwise the rank keeping the
      rest needs the moved head's K/V.
    - The imbalance ratio is ``max / mean`` of rank workloads in float64.

``flashcp+`` (improved, parameter ``target_imbalance``, default 1.01)
    Built on Algorithm 1 with five changes, each aimed at communication or balance:

    1. Tail-anchored splitting. Documents whose own workload exceeds the mean rank workload ("heavy") must
       be split. Instead of cutting all of a heavy document into 2N chunks, its tail ``[d - t, d)`` stays on
       one anchor rank (the rank with the least estimated workload) and only its head ``[0, d - t)`` is
       zigzagged. ``t`` is the longest tail the anchor can hold within the mean workload, counting its
       share of the zigzagged heads, and within its token quota. The tail is a document's last shard, so it
       costs nothing in the all-gather and only ``d - t`` tokens are ever sent.
    2. Token-aware greedy: each whole document goes to the least-loaded rank that still has room for it
       under its token quota (the least-loaded rank overall when none has).
    3. Token repair moves whole documents first: while a rank is over quota, it gives away the longest
       whole document that fits both its excess and some under-filled rank's deficit (ties: lower document,
       then the receiver with less workload); only when none fits does it cut a head, from its longest
       whole document (else its longest piece), for the under-filled rank with the least workload.
    4. Levers: for every zigzag document, the boundary between ranks i and i+1's early chunks and the one
       between their late chunks move together by ``delta``. Tokens stay equal on every rank and exactly
       ``delta * gap`` workload moves between the two ranks (``gap`` = distance between the boundaries), so
       a chain of such moves along ranks 0..N-1 balances workload almost exactly at nearly no extra
       communication. Each ``delta`` is rounded to the nearest integer and clamped so every chunk stays
       non-negative (ranges computed backwards from the last rank).
    5. Window swaps, while the busiest rank ``a`` is above the target: for the lightest ranks ``b`` below
       the mean, ``a`` gives the window ``[p, p + t)`` of its longest whole document to ``b`` and takes
       ``b``'s whole document of ``t`` tokens; tokens stay equal and ``p * t`` workload moves. The
       document with the smallest ``max(p, t)`` (the communication it adds) is chosen; at most 4N swaps.

    The first candidate sets aside exactly the heavy documents (tail-anchored). If it misses the target,
    further candidates zigzag the k longest documents whole (k = max(1, heavy), ...) as Algorithm 1 does,
    with changes 2-5; the first within the target wins, else the most balanced one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashcp.planner._kernels import flashcp_kernel, llama3_kernel, perdoc_kernel
from flashcp.planner._plus import flashcp_plus_kernel
from flashcp.planner.plan import SequencePlan

__all__ = ["MAX_CONTEXT_LEN", "STRATEGIES", "Strategy", "get_strategy", "plan_sequence"]

MAX_CONTEXT_LEN = 1 << 24
"""Longest sequence the kernels accept: keeps every workload sum times ``cp`` inside int64."""
MAX_CP = 1 << 12
"""Largest CP size the kernels accept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A named sharding strategy."""

    name: str
    """Registry name, used in plan names (``cp8-<name>``)."""
    code: int
    """Integer id the batch kernel dispatches on."""
    defaults: dict
    """Parameters and their defaults (``target_imbalance`` for the flashcp family)."""
    description: str
    """One line for help texts."""
    kernel: Callable
    """The per-sequence Numba kernel."""

    def plan(self, doc_lens, cp: int, *, target_imbalance: float | None = None) -> SequencePlan:
        """Plan one packed sequence: ``doc_lens`` (num_docs,) positive integers -> SequencePlan."""
        params = resolve_params(self, target_imbalance)
        lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        if lens.ndim != 1 or lens.size == 0 or (lens <= 0).any():
            raise ValueError("doc_lens must be a non-empty 1-D array of positive lengths")
        check_shape(int(lens.sum()), cp)
        doc, start, length, rank = run_kernel(self, lens, cp, params)
        return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy(name="llama3", code=0, defaults={}, kernel=llama3_kernel,
             description="2N equal chunks of the whole sequence, zigzag over ranks"),
    Strategy(name="perdoc", code=1, defaults={}, kernel=perdoc_kernel,
             description="every document in 2N chunks, zigzag over ranks"),
    Strategy(name="flashcp", code=2, defaults={"target_imbalance": 1.05}, kernel=flashcp_kernel,
             description="the paper's Algorithm 1: whole docs, Whole-Doc heads, Per-Doc for the longest"),
    Strategy(name="flashcp+", code=3, defaults={"target_imbalance": 1.01}, kernel=flashcp_plus_kernel,
             description="Algorithm 1 + tail-anchored splits, token-aware greedy, levers, window swaps"),
)}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy '{name}': choose one of {', '.join(STRATEGIES)}") from None


def resolve_params(strategy: Strategy, target_imbalance: float | None = None) -> dict:
    """The strategy's parameters with ``target_imbalance`` filled in (its default when None)."""
    params = dict(strategy.defaults)
    if target_imbalance is not None:
        if "target_imbalance" not in params:
            raise ValueError(f"strategy '{strategy.name}' takes no target imbalance")
        if not target_imbalance >= 1.0:
            raise ValueError(f"target imbalance must be at least 1.0, got {target_imbalance}")
        params["target_imbalance"] = float(target_imbalance)
    return params


def check_shape(context_len: int, cp: int) -> None:
    """ValueError unless ``1 <= cp <= min(MAX_CP, context_len)`` and the context length is supported."""
    if context_len < 1 or context_len > MAX_CONTEXT_LEN:
        raise ValueError(f"context length must be in [1, {MAX_CONTEXT_LEN}], got {context_len}")
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    if cp > context_len:
        raise ValueError(f"cp {cp} is above the {context_len} tokens per sequence: some rank would get none")
    if cp > MAX_CP:
        raise ValueError(f"cp {cp} is above the largest supported CP size {MAX_CP}")


def run_kernel(strategy: Strategy, lens: np.ndarray, cp: int, params: dict):
    """Call the strategy's kernel on contiguous int64 ``lens``; returns the four shard arrays."""
    if "target_imbalance" in strategy.defaults:
        return strategy.kernel(lens, cp, float(params["target_imbalance"]))
    return strategy.kernel(lens, cp)


def plan_sequence(strategy: str, doc_lens, cp: int, *, target_imbalance: float | None = None) -> SequencePlan:
    """Plan one packed sequence with the named strategy.

    ``doc_lens``: (num_docs,) positive integers; ``target_imbalance`` defaults to the strategy's own.
    Raises ValueError for an unknown strategy or bad input.
    """
    return get_strategy(strategy).plan(doc_lens, cp, target_imbalance=target_imbalance)
