"""Several packed sequences in one micro-batch: one longer varlen batch per rank, attention kept per sequence.

A micro-batch of ``B`` packed sequences runs as one sequence whose documents are those of all ``B``, one
sequence after the other. Documents never cross a sequence boundary, so the document mask keeps every token's
attention inside its own sequence, exactly as ``B`` separate forwards would; the model runs one forward and one
backward, ``cp_attention`` one varlen kernel call and one K/V exchange per layer for all ``B``.

The combined plan is the ``B`` plans' rows one after the other, each sequence's document indices shifted past
the previous sequences' documents. A rank's local layout is its shards in row order, so its tokens are its
tokens of sequence 0, then of sequence 1, ...: the loader's per-sequence tensors concatenated. The meta is
built from the combined plan (``CPAttnMeta.from_plan``), like any sequence's; every rank builds it alike.

Shape legend: ``T`` this rank's tokens of all ``B`` sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from flashcp.planner.plan import SequencePlan
from flashcp.runtime.loader import Batch
from flashcp.runtime.meta import CPAttnMeta

__all__ = ["concat_batches", "concat_plans"]


def concat_plans(plans: Sequence[SequencePlan], doc_lens: Sequence[np.ndarray]) -> tuple[SequencePlan, np.ndarray]:
    """The plan and document lengths of ``len(plans)`` sequences run as one (module docstring).

    ``plans[i]`` shards the sequence with documents ``doc_lens[i]``; all plans have the same ``cp``. Returns
    ``(plan, doc_lens)`` of the combined sequence. Raises ValueError for no plans or plans of different ``cp``.
    """
    if not plans or len(plans) != len(doc_lens):
        raise ValueError(f"concat_plans needs one plan per sequence, got {len(plans)} plans and {len(doc_lens)} "
                         "sequences' document lengths")
    cps = sorted({plan.cp for plan in plans})
    if len(cps) != 1:
        raise ValueError(f"the sequences of one micro-batch must be planned for one cp, got plans for cp {cps}")
    lens = [np.asarray(lens, dtype=np.int64) for lens in doc_lens]
    first_doc = np.cumsum([0] + [lens_i.size for lens_i in lens])[:-1]
    combined = SequencePlan.from_arrays(
        np.concatenate([plan.shard_doc + first for plan, first in zip(plans, first_doc)]),
        np.concatenate([plan.shard_start for plan in plans]), np.concatenate([plan.shard_len for plan in plans]),
        np.concatenate([plan.shard_rank for plan in plans]), cps[0])
    return combined, np.concatenate(lens)


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One rank's ``B`` packed sequences as one batch (module docstring); one batch is returned as it is.

    The batches are this rank's (the same ``attn.rank``), on the host, from ``CPLoader`` (which records each
    sequence's plan and document lengths). The result's ``input_ids``, ``position_ids`` and ``labels`` (T,) are
    theirs concatenated, its ``attn`` the combined plan's meta for this rank, ``num_label_tokens`` their sum;
    ``file_index`` and ``row`` are the first sequence's. Raises ValueError (one sentence) for no batches, a
    batch without its plan, or batches of different ranks.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    if len(batches) == 1:
        return batches[0]
    if any(batch.plan is None or batch.doc_lens is None for batch in batches):
        raise ValueError("concat_batches builds the attention meta from each sequence's plan, but a batch has no "
                         "plan or doc_lens; take the batches from CPLoader")
    ranks = sorted({batch.attn.rank for batch in batches})
    if len(ranks) != 1:
        raise ValueError(f"concat_batches joins one rank's sequences, got batches of ranks {ranks}")
    plan, doc_lens = concat_plans([b.plan for b in batches], [b.doc_lens for b in batches])  # type: ignore[misc]
    first = batches[0]
    return replace(first, input_ids=torch.cat([b.input_ids for b in batches]),
                   position_ids=torch.cat([b.position_ids for b in batches]),
                   labels=torch.cat([b.labels for b in batches]),
                   attn=CPAttnMeta.from_plan(plan, doc_lens, ranks[0]),
                   num_label_tokens=sum(b.num_label_tokens for b in batches), plan=plan, doc_lens=doc_lens)
