"""Scenario ``ring-cost``: what the ring baselines cost by the cost model, beside the collective baselines.

Per source and CP size, for the paper's five systems as layout + comm (``SYSTEMS``), averaged over sequences
(per-rank numbers: the largest over ranks): imbalance, kernel calls and varlen sequences (query shards, summed
over calls), the query rows merged by log-sum-exp and the keys the kernels read (relative to the rank's tokens
T; gathered copies unless they form one run of rows, as in the ring layout), and K/V tokens received per
forward pass (backward moves the same again for the collectives, twice that for the ring). All from
``flashcp.costmodel.comm`` (``ring_step_work``, ``ring_comm_tokens``) and the runtime's ``build_rank_metas``.

Sequences: a distribution's document lengths are drawn (256 at a time) from its length list and rounded up to
a multiple of 2N, the last one cut to fit the context, so that every layout splits documents exactly; ``pile``
has no length list (it is a mixture model), so it is drawn from a log-normal stand-in (median 1024 tokens,
sigma 1.4) and labelled ``pile~lognormal``. A dataset's own sequences are used as they are.
"""

from __future__ import annotations

import math

import numpy as np

from flashcp.bench.systems import plan_for

__all__ = ["SYSTEMS", "draw_aligned_sequence", "ring_cost"]

SYSTEMS = {("llama3", "full"): "Llama3 CP", ("perdoc", "full"): "Per-Doc CP", ("ring", "ring"): "Ring-Attn",
           ("perdoc", "ring"): "Ring-Attn (zigzag)", ("flashcp", "auto"): "FlashCP"}
"""(layout strategy, comm mode) -> the paper's name of that system."""
DRAW = 256
"""Documents drawn per sequence (more than any sequence needs)."""


def draw_aligned_sequence(rng: np.random.Generator, pool: np.ndarray | None, context_len: int,
                          cp: int) -> np.ndarray:
    """Document lengths filling ``context_len``, each a multiple of ``2 * cp`` but the last (cut to fit).

    ``pool``: the lengths to draw from; None draws from the log-normal stand-in for Pile.
    """
    unit = 2 * cp
    if pool is not None:
        sample = rng.choice(pool, size=DRAW)
    else:
        sample = np.maximum(1, rng.lognormal(math.log(1024), 1.4, size=DRAW)).astype(np.int64)
    lens, total = [], 0
    for n in -(-sample // unit) * unit:
        n = int(min(n, context_len - total))
        lens.append(n)
        total += n
        if total == context_len:
            return np.array(lens, dtype=np.int64)
    raise ValueError(f"{DRAW} documents did not fill a context of {context_len} tokens")


def _collective_row(plan, doc_lens, cp: int, comm: str) -> dict:
    """A collective mode: a local and a remote kernel call at most, shards over key prefixes."""
    from flashcp.costmodel.workload import rank_tokens
    from flashcp.runtime.meta import build_rank_metas

    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    shards = np.bincount(plan.shard_rank, minlength=cp)
    prefix_keys = np.bincount(plan.shard_rank, weights=plan.shard_start + plan.shard_len, minlength=cp)
    metas = build_rank_metas(plan, doc_lens)
    calls = max((m.local.num_tokens > 0) + (m.remote.num_tokens > 0) for m in metas)
    return {"calls": float(calls), "sequences": float(shards.max()), "merged": 0.0,
            "gathered": float((prefix_keys / tokens).max()),
            "recv": float(max(m.wire_tokens(comm)[1] for m in metas))}


def _ring_row(plan, cp: int) -> dict:
    """The ring: one call per step with work; partial outputs merged at every step after the first."""
    from flashcp.costmodel.comm import ring_comm_tokens, ring_step_work
    from flashcp.costmodel.workload import rank_tokens

    work = ring_step_work(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    tokens = rank_tokens(plan.shard_len, plan.shard_rank, cp)
    return {"calls": float(work.kernel_calls.max()), "sequences": float(work.sequences.sum(axis=1).max()),
            "merged": float((work.query_tokens[:, 1:].sum(axis=1) / tokens).max()),
            "gathered": float((work.key_tokens.sum(axis=1) / tokens).max()),
            "recv": float(ring_comm_tokens(plan.shard_len, plan.shard_rank, cp)[1].max())}


def _sequences(book, source, num_seqs: int, context_len: int, cp: int, seed: int) -> tuple[str, list]:
    if source.is_dataset:
        return source.label, book.sequences(source, num_seqs, source.dataset_context_len)
    from flashcp.data.synth import load_distribution

    pool = load_distribution(source.spec).lengths
    rng = np.random.default_rng(seed)
    label = source.label if pool is not None else f"{source.label}~lognormal"
    return label, [draw_aligned_sequence(rng, pool, context_len, cp) for _ in range(num_seqs)]


def ring_cost(book, sources, strategies: list[str], cps: list[int], context_len: int, num_seqs: int,
              seed: int) -> dict:
    """Rows per (source, cp, system), means over sequences; see the module docstring."""
    from flashcp.costmodel.workload import rank_workloads

    configs = [key for key in SYSTEMS if key[0] in strategies]
    rows = []
    for source in sources:
        for cp in cps:
            label, sequences = _sequences(book, source, num_seqs, context_len, cp, seed)
            for layout, comm in configs:
                per_seq = []
                for doc_lens in sequences:
                    plan = plan_for(layout, doc_lens, cp)
                    work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, cp)
                    row = _ring_row(plan, cp) if comm == "ring" else _collective_row(plan, doc_lens, cp, comm)
                    per_seq.append({"imbalance": work.max() / work.mean(), **row})
                mean = {key: float(np.mean([r[key] for r in per_seq])) for key in per_seq[0]}
                c = int(sequences[0].sum())
                rows.append({"source": label, "context_len": c, "cp": cp, "system": SYSTEMS[(layout, comm)],
                             "layout": layout, "comm": comm, "num_seqs": len(sequences), **mean,
                             "recv_over_c": mean["recv"] / c})
    return {"rows": rows}
