"""Small datasets and a simple heuristic plan for the ILP audit tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flashcp.costmodel.objective import sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.costmodel.workload import token_quotas, workload
from flashcp.data.dataset import Dataset, data_table, write_data_file, write_manifest
from flashcp.planner.plan import SequencePlan
from flashcp.planner.plan_writer import plan_table, write_plan_file, write_plan_json


def greedy_plan(doc_lens, cp: int, per_doc: int = 0) -> SequencePlan:
    """The ``per_doc`` longest documents cut into 2N zigzag chunks; the others whole to the least-loaded rank
    (longest first); then heads of the over-full ranks' longest whole documents cut off and given to the
    under-full ranks until every rank holds its quota."""
    doc_lens = np.asarray(doc_lens, dtype=np.int64)
    quotas = token_quotas(int(doc_lens.sum()), cp)
    work = np.zeros(cp, dtype=np.int64)
    tokens = np.zeros(cp, dtype=np.int64)
    owner, pieces = {}, {}
    by_length = np.argsort(-doc_lens, kind="stable").tolist()
    for d in by_length[:per_doc]:
        bounds = np.linspace(0, doc_lens[d], 2 * cp + 1).astype(np.int64)
        pieces[d] = []
        for i in range(2 * cp):
            r = min(i, 2 * cp - 1 - i)
            start, n = int(bounds[i]), int(bounds[i + 1] - bounds[i])
            if n:
                pieces[d].append((start, n, r))
                work[r] += workload(start, n)
                tokens[r] += n
    for d in by_length[per_doc:]:
        r = int(np.argmin(work))
        owner[d] = r
        work[r] += workload(0, int(doc_lens[d]))
        tokens[r] += int(doc_lens[d])
    pieces.update({d: [(0, int(doc_lens[d]), r)] for d, r in owner.items()})
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


def balanced_plan(doc_lens, cp: int, target_imbalance: float = 1.05) -> SequencePlan:
    """``greedy_plan`` with the fewest zigzag-cut documents that reach ``target_imbalance``."""
    for per_doc in range(len(doc_lens) + 1):
        plan = greedy_plan(doc_lens, cp, per_doc)
        if plan.metrics().imbalance <= target_imbalance:
            break
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
                           np.array([m.a2a_comm_tokens for m in metrics]),
                           sequence_flops(offsets, lens, AttentionShape()))
        plan_files.append(write_plan_file(plan_dir, i, table))
    write_plan_json(plan_dir, dataset=dataset, strategy="greedy", params={}, cp=cp, plan_files=plan_files,
                    summary={})
    return name
