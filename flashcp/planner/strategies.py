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

``magi`` (MagiAttention's MinHeap dispatch, parameter ``chunk_size``, default 512)
    The sequence is cut into chunks of ``chunk_size`` tokens (the last one shorter); a chunk's workload is
    that of its pieces cut at document bounds. Chunks are taken by decreasing workload (ties: the later
    chunk first, as MagiAttention reverses an ascending stable sort); each goes to the rank with the least
    workload that has room for all of it (ties: lowest rank). When ``C`` is a multiple of ``N *
    chunk_size`` every rank gets exactly ``C / (N chunk_size)`` chunks, which is MagiAttention's rule (at
    most ``ceil(chunks / N)`` per bucket). Otherwise, when no rank has room for a whole chunk, the
    least-loaded rank with room takes the chunk's head that fits and the rest goes on, head first, to the
    least-loaded rank with room; so quotas hold for any C.

``ptrr`` (PyTorch's ``_PTRRLoadBalancer``, parameter ``chunk_size``, default 128 = flex_attention's block)
    Query block i of ``chunk_size`` tokens has process time ``i - floor(s / b) + 1``, the key blocks it reads
    under the document-causal mask (``s`` = start of the document holding its first token). Blocks are
    sorted by decreasing process time (stable: ties keep block order); row k of N blocks is dealt to ranks
    0..N-1 when k is even and N-1..0 when k is odd. When ``C`` is a multiple of ``N * chunk_size`` (what
    torch requires) this is torch's assignment; otherwise a rank without room for its block takes the head
    that fits and the rest goes on to the rank with room and the least process time so far.

``dcp`` (DCP's hypergraph partitioning, SOSP'25; parameter ``chunk_size``, default 512; needs ``mtkahypar``)
    Every document is cut into ``chunk_size``-token blocks from its start; blocks are vertices weighted by
    their workload, and block b's K/V need (b and every later block of its document) is a net weighted by
    its tokens, so the partitioner's connectivity objective is the plan's total exact-need traffic.
    Mt-KaHyPar splits the blocks into N parts (epsilon 0.01, deterministic, one thread); then, as
    Algorithm 1's Whole-Doc step does, the rank most over its quota moves the head of its piece with the
    shortest prefix to the under-filled rank with the least workload until every rank holds its quota
    (``flashcp.planner.hypergraph``). Planned in Python; without the package it refuses in one sentence.

``flashcp2`` (parameters ``target_imbalance`` 1.05, ``effort`` 1, ``objective`` "time", ``profile``, shape,
``topology``)
    Per sequence, a portfolio under the step-time objective (``flashcp.planner.objective``: the projected
    step time of ``flashcp bench`` for one layer of H = H_kv = 32, D = 128 by default, auto comm with local
    shards overlapping the exchange). ``target_imbalance`` is a ceiling, not a goal: inside it the step
    time, which charges the slowest rank, decides; a candidate above it is never taken. The first plan is
    ``flashcp+`` at its own target 1.01 (or the ceiling when lower), its search stopped at 8 zigzagged
    documents (``_bounded.flashcp_plus_bounded``: the same plan whenever ``flashcp+`` needs no more). Then,
    in order: Algorithm 1 (R = 1.05) when it needs at most 8 Per-Doc documents, which replaces the first
    plan when faster (the two set the time to beat: the result is never slower than either of them when
    they meet the ceiling); ``flashcp+`` at the ceiling (when above 1.01, same bound); chunked assignments
    that keep documents contiguous (``_search.affinity_kernel``: every document cut into chunks from its
    end, chunks by decreasing workload to the least-loaded rank with room, except that the rank holding the
    next chunk of the same document takes it while it stays within the mean workload and within
    ``tolerance * mean`` of the least-loaded rank; chunks are fractions of a rank's quota ``q = C // N``:
    (chunk, tolerance) = (q/4, 0.03), (q/8, 0.1), (q/8, 0.01), (q/16, 0.01), (q/8, 0.03), (q/4, 0.01),
    (q/16, 0.03), (q/16, 0.1), i.e. 2048, 1024 and 512 tokens at C = 131072, N = 16), ``magi`` at q/8
    tokens, ``llama3``; effort 2 and more add ``magi`` at q/16 and q/4; effort 0 tries only the first three
    chunked assignments. A candidate with more than ``num_docs + 32 N`` shards (``MAX_EXTRA_SHARDS``) is
    not taken, nor is one slower than ``flashcp+``. When the first plan misses the ceiling, the first
    candidate within it replaces it (if none is as fast, ``flashcp+``'s plan stays: the result is never slower
    than ``flashcp+``); otherwise a candidate not slower than the time to beat replaces the best one when
    it is faster by more than ``RECEIVE_TIE`` (2%) of the best time, or not faster but no less balanced
    and within that share with a lower largest exact-need receive (equal: faster). A candidate whose busiest rank alone
    (``objective.rank_floor``) is too slow to win is skipped unpriced, which changes nothing. Then, with
    ``effort`` > 0, local search: paired moves of two document boundaries between the same two ranks by the
    same shift (1024, 256, 64, 16 tokens) so every rank keeps its quota, kept when the step time drops, the
    imbalance stays within the ceiling (or the chosen plan's own, when above) and the largest receive does
    not grow; passes repeat while one improves, for at most ``16 * effort`` evaluations. The bounds keep the
    planning time of a sequence to a few candidates and a fixed search budget, whatever the sequence.

    Topology (``topology`` "NODESxGPUS", or the profile's ``gpus_per_node``): rank r is on node
    ``r // GPUS``; the objective prices rows between nodes at the profile's ``inter_node_gbps`` and rows
    inside one at ``link_gbps`` (both links at once: the slower side of the busiest rank decides). Every
    candidate's ranks are then placed on nodes before it is priced (``_topology.relabel_kernel``): ranks of
    equal tokens are swapped between nodes while the largest cross-node rows of one rank (then the total
    crossing) drop, which keeps a document's pieces inside one node where the plan allows it; the search
    then prices moves with both links.

    Token slack (``token_slack`` F, default 0, beyond the paper): a rank may hold up to ``floor(F C / N)``
    tokens more or fewer than its quota. The objective then also prices every rank's per-token layers
    (projections and MLP, ``objective.ObjectiveShape.token_flops``), and each search pass first tries single
    boundary moves that keep both ranks within that window. Plans record ``token_slack`` in plan.json; the
    portfolio's candidates keep exact quotas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from flashcp.planner import _batch
from flashcp.planner._kernels import flashcp_kernel, llama3_kernel, perdoc_kernel, ring_kernel
from flashcp.planner._peers import magi_kernel, ptrr_kernel
from flashcp.planner._plus import flashcp_plus_kernel
from flashcp.planner._search import flashcp2_kernel
from flashcp.planner.hypergraph import MISSING, dcp_available, dcp_rows
from flashcp.planner.plan import SequencePlan

__all__ = ["DEFAULT_STRATEGY", "MAX_CONTEXT_LEN", "STRATEGIES", "Strategy", "check_context_len",
           "get_strategy", "plan_sequence"]

DEFAULT_STRATEGY = "flashcp2"
"""What ``flashcp plan`` uses unless told otherwise."""
OBJECTIVES = ("time",)
"""Objectives ``flashcp2`` optimises: ``time`` = the projected step time."""

MAX_CONTEXT_LEN = 1 << 24
"""Longest sequence the kernels accept: keeps every workload sum times ``cp`` inside int64. The one limit of
flashcp: ``pack``, ``synth``, ``plan`` and ``bench`` refuse a longer context before any work."""
MAX_CP = 1 << 12
"""Largest CP size the kernels accept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A named sharding strategy."""

    name: str
    """Registry name, used in plan names (``cp8-<name>``); the batch kernel is compiled once per name."""
    defaults: dict
    """Parameters and their defaults (``target_imbalance`` for the flashcp family)."""
    description: str
    """One line for help texts."""
    kernel: Callable | None
    """The per-sequence Numba kernel: ``kernel(lens, cp, *kernel_params) -> (doc, start, len, rank)``."""
    kernel_params: tuple[str, ...] = ()
    """What the kernel takes after ``(lens, cp)``, from ``_batch.KERNEL_PARAMS`` (``kernel_args`` builds
    them from the parameters)."""
    rows: Callable | None = None
    """A strategy planned in Python instead (``dcp``: a C++ partitioner behind a Python binding):
    ``rows(row_offsets, doc_lens, cp, params)`` returns what ``_batch.plan_batch`` returns; ``kernel`` is
    then None."""
    missing: Callable[[], str | None] | None = None
    """A check run before planning: the sentence refusing the strategy (a missing package), or None."""

    def plan(self, doc_lens, cp: int, *, target_imbalance: float | None = None, **overrides) -> SequencePlan:
        """Plan one packed sequence: ``doc_lens`` (num_docs,) positive integers -> SequencePlan.

        ``overrides`` set other parameters of the strategy (``chunk_size``, ``effort``, ``profile``, ...).
        """
        params = resolve_params(self, target_imbalance, **overrides)
        lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        if lens.ndim != 1 or lens.size == 0 or (lens <= 0).any():
            raise ValueError("doc_lens must be a non-empty 1-D array of positive lengths")
        check_shape(int(lens.sum()), cp, params)
        doc, start, length, rank = run_kernel(self, lens, cp, params)
        return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy(name="llama3", defaults={}, kernel=llama3_kernel,
             description="2N equal chunks of the whole sequence, zigzag over ranks"),
    Strategy(name="perdoc", defaults={}, kernel=perdoc_kernel,
             description="every document in 2N chunks, zigzag over ranks"),
    Strategy(name="flashcp", defaults={"target_imbalance": 1.05}, kernel=flashcp_kernel, kernel_params=("target",),
             description="the paper's Algorithm 1: whole docs, Whole-Doc heads, Per-Doc for the longest"),
    Strategy(name="flashcp+", defaults={"target_imbalance": 1.01}, kernel=flashcp_plus_kernel,
             kernel_params=("target",),
             description="Algorithm 1 + tail-anchored splits, token-aware greedy, levers, window swaps"),
    Strategy(name="ring", defaults={}, kernel=ring_kernel,
             description="N contiguous equal chunks, chunk i on rank i (the Ring-Attn layout)"),
    Strategy(name="magi", defaults={"chunk_size": 512}, kernel=magi_kernel, kernel_params=("chunk",),
             description="MagiAttention's MinHeap dispatch of chunk_size-token chunks"),
    Strategy(name="ptrr", defaults={"chunk_size": 128}, kernel=ptrr_kernel, kernel_params=("chunk",),
             description="PyTorch's PTRR load balancer: blocks by process time, dealt in snake order"),
    Strategy(name="dcp", defaults={"chunk_size": 512}, kernel=None, kernel_params=("chunk",), rows=dcp_rows,
             missing=lambda: None if dcp_available() else MISSING,
             description="DCP's hypergraph partitioning of blocks (needs pip install 'flashcp[hypergraph]')"),
    Strategy(name="flashcp2",
             defaults={"target_imbalance": 1.05, "effort": 1, "objective": "time", "profile": None,
                       "num_heads": 32, "num_kv_heads": 32, "head_dim": 128, "layers": 1, "token_slack": 0.0,
                       "topology": None},
             kernel=flashcp2_kernel, kernel_params=("target", "effort", "model", "slack"),
             description="portfolio + local search under the projected step time, never slower than flashcp+"),
)}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy '{name}': choose one of {', '.join(STRATEGIES)}") from None


def resolve_params(strategy: Strategy, target_imbalance: float | None = None, **overrides) -> dict:
    """The strategy's parameters with ``target_imbalance`` and ``overrides`` filled in (defaults for None).

    ValueError for a parameter the strategy does not take or a bad value.
    """
    params = dict(strategy.defaults)
    if target_imbalance is not None:
        if "target_imbalance" not in params:
            raise ValueError(f"strategy '{strategy.name}' takes no target imbalance")
        if not target_imbalance >= 1.0:
            raise ValueError(f"target imbalance must be at least 1.0, got {target_imbalance}")
        params["target_imbalance"] = float(target_imbalance)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in params:
            raise ValueError(f"strategy '{strategy.name}' takes no {key.replace('_', ' ')}")
        params[key] = value
    if "chunk_size" in params and not (isinstance(params["chunk_size"], int)
                                       and 1 <= params["chunk_size"] <= MAX_CONTEXT_LEN):
        raise ValueError(f"chunk size must be a positive integer of at most {MAX_CONTEXT_LEN} (the longest "
                         f"context), got {params['chunk_size']}")
    if "effort" in params:
        from flashcp.planner.polish import parse_effort

        parse_effort(params["effort"])
    if "token_slack" in params:
        slack = params["token_slack"]
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < 1:
            raise ValueError(f"token slack must be a number in [0, 1), got {slack}")
        params["token_slack"] = float(slack)
    if params.get("topology") is not None:
        params["topology"] = format_topology(*parse_topology(params["topology"]))
    if "objective" in params and params["objective"] not in OBJECTIVES:
        raise ValueError(f"unknown objective '{params['objective']}': choose one of {', '.join(OBJECTIVES)}")
    return params


def parse_topology(text) -> tuple[int, int]:
    """``"NODESxGPUS"`` (e.g. ``"2x8"``) -> (nodes, GPUs per node); ValueError in one sentence otherwise."""
    nodes, sep, gpus = str(text).lower().partition("x")
    if not sep or not nodes.isdigit() or not gpus.isdigit() or int(nodes) < 1 or int(gpus) < 1:
        raise ValueError(f"topology must be NODESxGPUS with two positive whole numbers (e.g. 2x8), got '{text}'")
    return int(nodes), int(gpus)


def format_topology(nodes: int, gpus: int) -> str:
    """The canonical spelling of a topology, ``"2x8"``."""
    return f"{nodes}x{gpus}"


def gpus_per_node(params: dict) -> int | None:
    """CP ranks per node of a strategy's parameters: from ``topology``, else None (the profile's)."""
    topology = params.get("topology")
    return None if topology is None else parse_topology(topology)[1]


def plan_gpus_per_node(params: dict) -> int:
    """CP ranks per node a plan was made for (0: every rank in one node).

    Its ``topology``, else its profile's ``gpus_per_node`` (for a strategy that takes a profile), else 0.
    """
    per_node = gpus_per_node(params)
    if per_node is not None:
        return per_node
    if "profile" not in params:
        return 0
    from flashcp.bench.profile import load_profile

    return load_profile(params["profile"]).gpus_per_node


def check_topology(params: dict, cp: int) -> None:
    """ValueError unless a ``topology`` in ``params`` has exactly ``cp`` ranks (NODES x GPUS == cp)."""
    topology = params.get("topology")
    if topology is not None:
        nodes, gpus = parse_topology(topology)
        if nodes * gpus != cp:
            raise ValueError(f"topology {topology} holds {nodes * gpus} ranks, not the {cp} of --cp {cp}")


def objective_model(params: dict) -> np.ndarray:
    """The step-time model vector of ``flashcp2`` parameters (profile file, model shape, topology); cached."""
    from flashcp.planner.objective import cached_model

    return cached_model(params.get("profile"), int(params.get("num_heads", 32)),
                        int(params.get("num_kv_heads", 32)), int(params.get("head_dim", 128)),
                        int(params.get("layers", 1)), float(params.get("token_slack", 0.0)) > 0,
                        gpus_per_node(params))


def kernel_args(strategy: Strategy, params: dict) -> dict:
    """The batch kernel's ``KERNEL_PARAMS`` (``target``, ``chunk``, ``effort``, ``model``, ``slack``).

    Built from a strategy's parameters; the step-time model (and its profile file) only for a kernel taking it.
    """
    from flashcp.planner.polish import parse_effort

    refusal = strategy.missing() if strategy.missing is not None else None
    if refusal:
        raise ValueError(refusal)
    model = objective_model(params) if "model" in strategy.kernel_params else None
    return {"target": float(params.get("target_imbalance", 1.0)), "chunk": int(params.get("chunk_size", 1)),
            "effort": parse_effort(params.get("effort", 0))[0], "model": model,
            "slack": float(params.get("token_slack", 0.0))}


def check_context_len(context_len: int, what: str = "context length") -> None:
    """ValueError when ``context_len`` is above ``MAX_CONTEXT_LEN`` (the same sentence for every command)."""
    if context_len > MAX_CONTEXT_LEN:
        raise ValueError(f"{what} {context_len:,} is above the longest context flashcp plans, "
                         f"{MAX_CONTEXT_LEN:,} tokens (2^24); choose a shorter one")


def check_shape(context_len: int, cp: int, params: dict | None = None) -> None:
    """ValueError unless ``1 <= cp <= min(MAX_CP, context_len)`` and the context length is supported.

    A ``topology`` in ``params`` must hold ``cp`` ranks.
    """
    check_context_len(context_len)
    if context_len < 1:
        raise ValueError(f"context length must be in [1, {MAX_CONTEXT_LEN}], got {context_len}")
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    if cp > context_len:
        raise ValueError(f"cp {cp} is above the {context_len} tokens per sequence: some rank would get none")
    if cp > MAX_CP:
        raise ValueError(f"cp {cp} is above the largest supported CP size {MAX_CP}")
    check_topology(params or {}, cp)


def run_kernel(strategy: Strategy, lens: np.ndarray, cp: int, params: dict):
    """Plan contiguous int64 ``lens`` as one row of the batch kernel; returns the four shard arrays.

    One compiled entry point per strategy, shared with ``pipeline.plan_rows``.
    """
    rows = np.array([0, lens.size], np.int64)
    args = kernel_args(strategy, params)
    if strategy.rows is not None:
        return strategy.rows(rows, lens, cp, params)[1:]
    return _batch.plan_batch(rows, lens, cp, strategy.name, **args)[1:]


def plan_sequence(strategy: str, doc_lens, cp: int, *, target_imbalance: float | None = None,
                  **overrides) -> SequencePlan:
    """Plan one packed sequence with the named strategy.

    ``doc_lens``: (num_docs,) positive integers; ``target_imbalance`` and ``overrides`` (``chunk_size``,
    ``effort``, ...) default to the strategy's own. Raises ValueError for an unknown strategy or bad input.
    """
    return get_strategy(strategy).plan(doc_lens, cp, target_imbalance=target_imbalance, **overrides)
