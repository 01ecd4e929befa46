"""Test helpers: simple plan generators (Llama3-like, Per-Doc-like, whole documents) and tiny datasets.

The real strategies live in ``flashcp.planner``; these only have to be valid plans with the patterns that
matter to the runtime (documents cut across chunk boundaries, a document on every rank, no sharing at all).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from flashcp.costmodel.objective import sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import token_quotas
from flashcp.data.dataset import Dataset, data_table, write_data_file, write_manifest
from flashcp.planner.plan import SequencePlan, check_metrics
from flashcp.planner.plan_writer import plan_table, write_plan_file, write_plan_json
from flashcp.planner.planning import plan_sequence
from tests.naive import naive_flashcp, naive_flashcp_plus, naive_llama3, naive_metrics, naive_perdoc, naive_ring_plan


def _cut(doc_lens, piece_sizes, piece_ranks, cp) -> SequencePlan:
    """Lay pieces (size, rank) along the packed sequence and cut them at document boundaries."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    doc_bounds = np.cumsum(doc_lens) - doc_lens
    piece_bounds = np.cumsum(piece_sizes) - piece_sizes
    cuts = np.union1d(doc_bounds, piece_bounds[np.asarray(piece_sizes) > 0])
    lengths = np.diff(np.r_[cuts, doc_lens.sum()])
    doc = np.searchsorted(doc_bounds, cuts, side="right") - 1
    rank = np.asarray(piece_ranks)[np.searchsorted(piece_bounds, cuts, side="right") - 1]
    keep = lengths > 0
    return SequencePlan.from_arrays(doc[keep], (cuts - doc_bounds[doc])[keep], lengths[keep], rank[keep],
                                    cp).sorted()


def llama3_like_plan(doc_lens, cp: int) -> SequencePlan:
    """The whole sequence in 2*cp chunks, rank i gets chunks i and 2*cp-1-i (sizes from the quotas)."""
    quotas = token_quotas(int(np.sum(doc_lens)), cp)
    sizes = [(q + 1) // 2 for q in quotas] + [q // 2 for q in quotas[::-1]]
    ranks = list(range(cp)) + list(range(cp))[::-1]
    return _cut(doc_lens, sizes, ranks, cp)


def perdoc_like_plan(doc_lens, cp: int) -> SequencePlan:
    """Every document in 2*cp near-equal chunks, rank i gets chunks i and 2*cp-1-i.

    Gives equal tokens only when every document length is a multiple of 2*cp.
    """
    docs, starts, lens, ranks = [], [], [], []
    owner = list(range(cp)) + list(range(cp))[::-1]
    for d, n in enumerate(doc_lens):
        sizes = [len(a) for a in np.array_split(np.arange(n), 2 * cp)]
        start = 0
        for chunk, size in enumerate(sizes):
            if size:
                docs.append(d), starts.append(start), lens.append(size), ranks.append(owner[chunk])
            start += size
    return SequencePlan.from_arrays(docs, starts, lens, ranks, cp).sorted()


def whole_docs_case(context_len: int, cp: int, rng: np.random.Generator) -> tuple[np.ndarray, SequencePlan]:
    """Random documents that deal out exactly to the quotas, each kept whole: ``(doc_lens, plan)``."""
    lens, ranks = [], []
    for rank, quota in enumerate(token_quotas(context_len, cp)):
        while quota > 0:
            n = int(rng.integers(1, quota + 1))
            lens.append(n), ranks.append(rank)
            quota -= n
    order = rng.permutation(len(lens))
    lens, ranks = np.array(lens)[order], np.array(ranks)[order]
    return lens, SequencePlan.from_arrays(np.arange(lens.size), np.zeros(lens.size), lens, ranks, cp)


def random_plan_builder(seed: int):
    """``plan_fn(doc_lens, cp)`` giving ``random_plan`` (harsh patterns, short shards) from a fixed seed."""
    from tests.emulate import random_plan

    def build(doc_lens, cp):
        return random_plan(doc_lens, cp, np.random.default_rng((seed, int(np.sum(doc_lens)), cp)),
                           max_pieces=4, cut_prob=0.05)

    return build


PEERS = ("magi", "ptrr", "dcp")
"""Strategies of other systems, left out of the end-to-end builders (their chunked layouts add nothing the
random plans and ``perdoc`` do not already cover, and every builder costs a distributed training run)."""


def plan_builders() -> dict:
    """Name -> ``plan_fn(doc_lens, cp) -> SequencePlan`` for end-to-end tests and benchmarks.

    Random plans (harsh patterns), then every strategy of the registry (``plan_sequence(name, doc_lens, cp)``)
    except the peers ``PEERS``.
    """
    from flashcp.planner import registry as strategies
    from flashcp.planner.planning import plan_sequence

    builders = {"random": random_plan_builder(0)}
    for name in strategies.STRATEGIES:
        if name in PEERS:
            continue
        builders[name] = partial(_plan_with_strategy, plan_sequence, name)
    return builders


def _plan_with_strategy(plan_sequence, name, doc_lens, cp):
    return plan_sequence(name, doc_lens, cp)


def random_rows(rng: np.random.Generator, num_seqs: int, context_len: int, cuts: tuple[int, int]) -> list[np.ndarray]:
    """``num_seqs`` rows of document lengths summing to ``context_len``, each cut at ``rng.integers(*cuts)``
    distinct random points."""
    rows = []
    for _ in range(num_seqs):
        at = np.sort(rng.choice(np.arange(1, context_len), size=int(rng.integers(*cuts)), replace=False))
        rows.append(np.diff(np.r_[0, at, context_len]))
    return rows


def write_dataset(root: Path, files: list[list[np.ndarray]], context_len: int, rng: np.random.Generator,
                  row_group_rows: int = 2, has_tokens: bool = True,
                  vocab_size: int = 50_000) -> tuple[Dataset, list[list[np.ndarray]]]:
    """Write a dataset whose ``files[i][j]`` are row j's document lengths (token ids below ``vocab_size``);
    returns it and the token rows."""
    data_files, token_rows = [], []
    for index, rows in enumerate(files):
        offsets = np.r_[0, np.cumsum([len(r) for r in rows])]
        lens = np.concatenate(rows)
        tokens = rng.integers(0, vocab_size, size=len(rows) * context_len).astype(np.int32)
        token_rows.append([tokens[i * context_len:(i + 1) * context_len] for i in range(len(rows))])
        table = data_table(offsets, lens, np.arange(lens.size), np.zeros(lens.size, np.int64),
                           tokens if has_tokens else None, context_len)
        data_files.append(write_data_file(root, index, table, row_group_rows))
    write_manifest(root, context_len=context_len, has_tokens=has_tokens, created_by="tests", tokenizer=None,
                   options={}, inputs=[], files=data_files, counts={})
    return Dataset(root), token_rows


def write_plan(dataset: Dataset, name: str, plans: list[list[SequencePlan]], cp: int,
               row_group_rows: int | None = None, seq_cost: bool = True) -> None:
    """Write plan files + plan.json for ``plans[i][j]`` (file i, row j).

    ``seq_cost``: write each sequence's price under the default shape (False: a plan file made before the
    column, which readers price themselves).
    """
    import flashcp.planner.plan_writer as plan_writer

    plan_dir = dataset.root / "plans" / name
    entries = []
    for index, rows in enumerate(plans):
        offsets = np.r_[0, np.cumsum([p.num_shards for p in rows])]
        metrics = [p.metrics() for p in rows]

        def cat(attr, rows=rows):
            return np.concatenate([getattr(p, attr) for p in rows])

        table = plan_table(offsets, cat("shard_doc"), cat("shard_start"), cat("shard_len"), cat("shard_rank"),
                           np.array([m.imbalance for m in metrics]),
                           np.array([m.ag_comm_tokens for m in metrics]),
                           np.array([m.a2a_comm_tokens for m in metrics]),
                           np.array([plan_seq_cost(p) for p in rows]) if seq_cost else None)
        saved = plan_writer.PLAN_ROW_GROUP_ROWS
        plan_writer.PLAN_ROW_GROUP_ROWS = row_group_rows or saved
        try:
            entries.append(write_plan_file(plan_dir, index, table))
        finally:
            plan_writer.PLAN_ROW_GROUP_ROWS = saved
    write_plan_json(plan_dir, dataset=dataset, strategy="test", params={}, cp=cp, plan_files=entries,
                    summary={})


def plan_seq_cost(plan: SequencePlan) -> float:
    """The price of the sequence ``plan`` covers, under the default shape (its documents from its shards)."""
    doc_lens = np.bincount(plan.shard_doc, weights=plan.shard_len).astype(np.int64)
    return float(sequence_flops([0, doc_lens.size], doc_lens, AttentionShape())[0])


# --- shared by the planner's property tests

def examples(n):
    """Hypothesis settings of ``n`` examples, no deadline (kernels compile on first use)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sequences(draw, max_docs=14, max_len=2500, max_cp=8):
    """Packed sequences of short and long documents, and a CP size that fits."""
    lens = draw(st.lists(st.one_of(st.integers(1, 60), st.integers(1, max_len)), min_size=1, max_size=max_docs))
    cp = draw(st.integers(1, min(max_cp, sum(lens))))
    return lens, cp


@st.composite
def mixed_sequences(draw, max_docs=24, max_len=3000):
    """Packed sequences with a mix of short and long documents, and a CP size that fits."""
    num_docs = draw(st.integers(1, max_docs))
    long_doc = st.integers(1, max_len)
    short_doc = st.integers(1, max(1, max_len // 20))
    lens = draw(st.lists(st.one_of(short_doc, short_doc, long_doc), min_size=num_docs, max_size=num_docs))
    cp = draw(st.integers(1, min(9, sum(lens))))
    return lens, cp


def as_tuples(plan):
    """A plan's shards as ``(doc, start, len, rank)`` tuples of ints."""
    return list(zip(*(np.asarray(a).tolist() for a in (plan.shard_doc, plan.shard_start, plan.shard_len,
                                                       plan.shard_rank))))


def packed(dist, num_seqs, context_len, seed=0):
    """``num_seqs`` packed sequences' document lengths from a built-in distribution, int64 arrays."""
    from flashcp.data.synth import load_distribution, pack_lengths

    offsets, lens, *_ = pack_lengths(load_distribution(dist), np.random.default_rng(seed), num_seqs, context_len)
    return [lens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(num_seqs)]


# the plain-Python reference of every strategy assert_same_as_reference checks
REFERENCES = {"llama3": naive_llama3, "perdoc": naive_perdoc, "flashcp": naive_flashcp,
              "flashcp+": naive_flashcp_plus, "ring": naive_ring_plan}


def assert_same_as_reference(name, lens, cp, **params):
    """Plan with the named strategy and require the plain-Python reference's plan and metrics."""
    got = plan_sequence(name, lens, cp, **params)
    expected = REFERENCES[name](lens, cp, *params.values())
    assert as_tuples(got) == expected, f"{name} cp={cp} lens={lens}"
    got.validate(lens)
    imbalance, ag, a2a = naive_metrics(expected, cp)
    check_metrics(got, imbalance, ag, a2a)
    return got

