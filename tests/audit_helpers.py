"""Small datasets and a simple heuristic plan for the ILP audit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flashcp.data.dataset import Dataset, data_table, write_data_file, write_manifest
from flashcp.planner.cost import token_quotas, workload
from flashcp.planner.plan import SequencePlan
from flashcp.planner.store import plan_table, write_plan_file, write_plan_json


def greedy_plan(doc_lens, cp: int) -> SequencePlan:
    """Whole documents to the least-loaded rank (longest first), then heads of the over-full ranks' longest
    documents cut off and given to the under-full ranks until every rank holds its quota."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    quotas = token_quotas(int(doc_lens.sum()), cp)
    work = np.zeros(cp, dtype=np.int64)
    tokens = np.zeros(cp, dtype=np.int64)
    owner = {}
    for d in np.argsort(-doc_lens, kind="stable").tolist():
        r = int(np.argmin(work))
        owner[d] = r
        work[r] += workload(0, int(doc_lens[d]))
        tokens[r] += int(doc_lens[d])
    pieces = {d: [(0, int(doc_lens[d]), r)] for d, r in owner.items()}
    deficit = np.maximum(quotas - tokens, 0)
    for a in range(cp):
        excess = int(tokens[a] - quotas[a])
        for d in sorted((d for d, r in owner.items() if r == a), key=lambda d: -doc_lens[d]):
            if excess <= 0:
                break
            length = int(doc_lens[d])
            head = min(excess, length)
            new, start = [], 0
            while start < head:
                b = int(np.flatnonzero(deficit > 0)[0])
                n = min(int(deficit[b]), head - start)
                new.append((start, n, b))
                deficit[b] -= n
                start += n
            if head < length:
                new.append((head, length - head, a))
            pieces[d] = new
            excess -= head
    rows = [(d, s, n, r) for d in sorted(pieces) for s, n, r in pieces[d]]
    doc, start, length, rank = (np.array(c) for c in zip(*rows))
    plan = SequencePlan.from_arrays(doc, start, length, rank, cp).sorted()
    plan.validate(doc_lens)
    return plan


def make_dataset(root: Path, sequences: list[list[int]], *, files: int = 1) -> Dataset:
    """A lengths-only dataset of the given sequences (all of one length), split over ``files`` data files."""
    context_len = sum(sequences[0])
    assert all(sum(s) == context_len for s in sequences)
    chunks = np.array_split(np.arange(len(sequences)), files)
    written = []
    for i, rows in enumerate(chunks):
        lens = [sequences[r] for r in rows]
        offsets = np.r_[0, np.cumsum([len(s) for s in lens])]
        flat = np.concatenate([np.array(s) for s in lens]) if lens else np.zeros(0, np.int64)
        source, offset = np.arange(flat.size), np.zeros(flat.size, np.int64)
        table = data_table(offsets, flat, source, offset, None, context_len)
        written.append(write_data_file(root, i, table, 64))
    write_manifest(root, context_len=context_len, has_tokens=False, created_by="test", tokenizer=None,
                   options={}, inputs=[], files=written, counts={})
    return Dataset(root)


def write_greedy_plan(dataset: Dataset, cp: int, name: str | None = None) -> str:
    """Plan every row of ``dataset`` with ``greedy_plan`` into ``plans/<name>`` (default ``cp<N>-greedy``)."""
    name = name or f"cp{cp}-greedy"
    plan_dir = dataset.root / "plans" / name
    plan_files = []
    for i in range(len(dataset.files)):
        offsets, lens = dataset.read_doc_lens(i)
        plans = [greedy_plan(lens[offsets[j]:offsets[j + 1]], cp) for j in range(offsets.size - 1)]
        metrics = [p.metrics() for p in plans]
        shard_offsets = np.r_[0, np.cumsum([p.num_shards for p in plans])]

        def cat(field, plans=plans):
            return np.concatenate([getattr(p, field) for p in plans])

        table = plan_table(shard_offsets, cat("shard_doc"), cat("shard_start"), cat("shard_len"),
                           cat("shard_rank"), np.array([m.imbalance for m in metrics]),
                           np.array([m.ag_comm_tokens for m in metrics]),
                           np.array([m.a2a_comm_tokens for m in metrics]))
        plan_files.append(write_plan_file(plan_dir, i, table))
    write_plan_json(plan_dir, dataset=dataset, strategy="greedy", params={}, cp=cp, plan_files=plan_files,
                    summary={})
    return name
