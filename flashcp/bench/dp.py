"""The DP step efficiency scenario: how busy the replicas of a data-parallel step are, stream order vs balanced.

A DP step trains ``dp`` packed sequences at once and waits for the most costly one. Each source's sequences are
priced with ``costmodel.objective.sequence_flops`` under the model's shape (``--model``: each attention layer by its
kind, recurrent layers by their tokens; Llama-3-8B by default) and grouped into
steps two ways: in the loader's stream order (a dataset: ``CPLoader``'s shuffled epoch order,
``runtime.loader.stream_rows``; a distribution: the order ``synth`` draws them in) and balanced
(``runtime.balance.balanced_epoch``: what ``CPLoader(balance_window=W)`` trains in its first epoch). Reported
per source and ``dp``: the efficiency (mean sequence cost over the mean of each step's largest,
``runtime.balance.step_efficiency``) of both, and the step-time speed-up their ratio gives (the same work in
fewer FLOP-equivalents of waiting). The heaviest sequence's cost over the lightest says how much there is to
balance. No plan is needed: the price does not depend on the sharding.
"""

from __future__ import annotations

import numpy as np

from flashcp.bench.sequences import SequenceSource
from flashcp.costmodel.models import ModelSpec
from flashcp.costmodel.objective import sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.data.dataset import Dataset
from flashcp.runtime.balance import balanced_epoch, step_efficiency
from flashcp.runtime.loader import stream_rows

__all__ = ["dp_scenario", "stream_costs"]


def stream_costs(source: SequenceSource, num_seqs: int, context_len: int, seed: int,
                 shape: AttentionShape) -> np.ndarray:
    """(n,) float64: the prices of ``source``'s first ``num_seqs`` sequences in stream order.

    A dataset at its own context length: its rows in ``CPLoader``'s epoch-0 order from ``seed``; otherwise the
    source's packed sequences as drawn.
    """
    if source.is_dataset and context_len == source.dataset_context_len:
        dataset = Dataset(source.spec)
        costs = np.concatenate([sequence_flops(*dataset.read_doc_lens(i), shape) for i in range(len(dataset.files))])
        return costs[stream_rows(source.spec, seed=seed)][:num_seqs]
    sequences = source.sequences(num_seqs, context_len, seed)
    offsets = np.r_[0, np.cumsum([s.size for s in sequences])]
    return sequence_flops(offsets, np.concatenate([*sequences, np.zeros(0, np.int64)]), shape)


def dp_scenario(sources: list[SequenceSource], dp_sizes: list[int], window: int, num_seqs: int,
                context_len: int, seed: int, model: ModelSpec) -> dict:
    """Every source's DP step efficiency at every ``dp`` in stream order and balanced (``window`` steps).

    Sequences are priced for ``model`` (``ModelSpec.attention_shape()``); the report names it.
    """
    shape = model.attention_shape()
    rows = []
    for source in sources:
        costs = stream_costs(source, num_seqs, context_len, seed, shape)
        for dp in dp_sizes:
            steps = costs.size // dp
            balanced = costs[balanced_epoch(costs, dp, window, seed=seed)]
            stream_eff, balanced_eff = step_efficiency(costs, dp), step_efficiency(balanced, dp)
            rows.append({"source": source.label, "context_len": context_len if not source.is_dataset
                         else source.dataset_context_len, "num_seqs": int(costs.size), "dp": dp, "steps": steps,
                         "window": window, "cost_ratio": float(costs.max() / costs.min()) if costs.size else 1.0,
                         "stream_efficiency": stream_eff, "balanced_efficiency": balanced_eff,
                         "speedup": balanced_eff / stream_eff if steps else 1.0})
    return {"model": model.describe(), "shape": shape.as_dict(), "rows": rows}
