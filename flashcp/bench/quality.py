"""Scenario 1, plan quality: every strategy on every source and CP size, with the cost model's metrics.

Per (source, cp, strategy), over the same packed sequences, planned in one batch by
``flashcp.planner.planning.plan_rows`` (what ``flashcp plan`` runs; every plan validated), the planner's own
summary (``planning.summarize``, what ``plan.json`` stores): imbalance ratio (mean, p50, max), the all-gather
comm saving against a full-KV all-gather (paper Eq. 5, ``cost.comm_saving``) and the exact-need saving against
what a rank receives in that all-gather (``cost.exact_need_saving``; ``received_pct`` is its complement, lower
is better). Beside them: shards per sequence and per rank, mean shard length (short shards make slow kernels),
the mean projected step time of one layer (``flashcp.costmodel.objective``: default H100 profile, one layer of
the bench's model, ``--model``, Llama-3-8B by default: H = 32, H_kv = 8, D = 128; auto comm, local shards
overlapping the exchange; with ``price_tokens`` also the per-token layers;
with ``gpus_per_node`` inter-node rows at the profile's ``inter_node_gbps``) and the seconds spent planning
the row (a shared machine: compare within one run only); optionally the CPU milliseconds per sequence.

A strategy spec may carry a target, ``flashcp+@1.05``, and parameters after a colon, separated by ``;``:
``magi:chunk_size=2048``, ``flashcp2:effort=4``, ``flashcp2:effort=2;token_slack=0.05``. ``flashcp2`` plans
for the bench's model; shape parameters in a spec (``flashcp2:num_kv_heads=32``) override the model's for that
spec's planning only (its plans are still priced for the model, the column every strategy shares).
"""

from __future__ import annotations

import time

import numpy as np

from flashcp.bench.systems import PlanBook
from flashcp.costmodel.models import ModelSpec

__all__ = ["parse_strategy", "plan_quality", "quality_targets"]

TARGET_CUTS = {16: {"wlb": 0.6, "prolong": 0.5}, 8: {"wlb": 0.9, "prolong": 0.9}}
"""cp -> source -> the largest receive ``flashcp2`` may have, as a share of ``flashcp+``'s (issue 13)."""


def _value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_strategy(spec: str, model: ModelSpec | None = None) -> tuple[str, str, dict]:
    """``(spec, strategy name, resolved parameters)`` of ``name[@target][:key=value;...]``.

    ``model``: the shape parameters a strategy takes (``flashcp2``'s) default to its shape; those the spec
    names override it. ValueError (one sentence) for an unknown strategy, parameter or bad value.
    """
    from flashcp.planner.params import model_params, resolve_params
    from flashcp.planner.registry import get_strategy

    head, _, rest = spec.partition(":")
    name, _, target = head.partition("@")
    overrides = {}
    for item in filter(None, rest.split(";")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"strategy '{spec}': expected key=value after ':', got '{item}'")
        overrides[key.strip().replace("-", "_")] = _value(value.strip())
    try:
        target_imbalance = float(target) if target else None
    except ValueError:
        raise ValueError(f"strategy '{spec}': the target after '@' must be a number, got '{target}'") from None
    chosen = get_strategy(name)
    if model is not None:
        overrides = {**model_params(chosen, {}, model), **overrides}
    return spec, name, resolve_params(chosen, target_imbalance, **overrides)


def plan_quality(book: PlanBook, sources, strategies: list[str], cps: list[int], context_len: int,
                 num_seqs: int, price_tokens: bool = False, gpus_per_node: int = 0,
                 time_sequences: bool = False, model: ModelSpec | None = None) -> dict:
    """Rows of plan metrics, one per (source, cp, strategy spec); see the module docstring.

    ``model``: what every plan is priced for, its mean layer (each layer kind by its share of the layers,
    ``AttentionShape.one_layer``; None: ``DEFAULT_MODEL``); the result names it (``model``,
    ``ModelSpec.as_dict()``).

    ``gpus_per_node`` > 0 prices every plan with that many ranks per node (``--gpus-per-node``) and adds the
    busiest rank's intra- and inter-node receive; ``time_sequences`` also plans every sequence on its own and
    reports the CPU milliseconds per sequence (p50, p99, max).
    """
    from flashcp.costmodel.comm import batch_node_received
    from flashcp.costmodel.models import DEFAULT_MODEL, resolve_model
    from flashcp.costmodel.objective import batch_step_seconds, model_vector
    from flashcp.costmodel.profile import load_profile
    from flashcp.planner.planning import plan_rows, summarize

    spec_model = model or resolve_model(DEFAULT_MODEL)
    shape, per_layer = spec_model.attention_shape().one_layer()
    specs = [parse_strategy(s, spec_model) for s in strategies]
    vector = model_vector(load_profile(None), shape, with_tokens=price_tokens, gpus_per_node=gpus_per_node)
    rows = []
    for source in sources:
        c = source.dataset_context_len or context_len
        sequences = book.sequences(source, num_seqs, c)
        offsets = np.r_[0, np.cumsum([s.size for s in sequences])].astype(np.int64)
        lens = np.concatenate(sequences).astype(np.int64)
        for cp in cps:
            for spec, name, params in specs:
                started = time.perf_counter()
                own_shape = any(params.get(key, getattr(shape, key)) != getattr(shape, key)
                                for key in ("num_heads", "num_kv_heads", "head_dim"))
                planned = plan_rows(offsets, lens, cp, name, params, shape=None if own_shape else shape)
                seconds = time.perf_counter() - started
                summary = summarize(planned.imbalance, planned.ag_comm_tokens, planned.a2a_comm_tokens, c, cp)
                steps = batch_step_seconds(planned.shard_offsets, planned.shard_doc, planned.shard_start,
                                           planned.shard_len, planned.shard_rank, cp, vector) / per_layer
                shards = np.diff(planned.shard_offsets)
                row = {"source": source.label, "context_len": c, "cp": cp, "strategy": spec,
                       "params": params, "num_seqs": len(sequences), **summary,
                       "received_pct": 100 * (1 - summary["a2a_saving_mean"]),
                       "shards_mean": float(shards.mean()), "shards_per_rank": float(shards.mean() / cp),
                       "shard_len_mean": float(c * len(sequences) / shards.sum()),
                       "step_ms": 1e3 * float(steps.mean()), "step_ms_all": (1e3 * steps).tolist(),
                       "seconds": seconds}
                if 0 < gpus_per_node < cp:
                    node = batch_node_received(planned.shard_offsets, planned.shard_doc, planned.shard_start,
                                               planned.shard_len, planned.shard_rank, cp, gpus_per_node)
                    full = (cp - 1) * c / cp
                    row.update(gpus_per_node=gpus_per_node, intra_pct=100 * float(node[:, 0].mean()) / full,
                               inter_pct=100 * float(node[:, 1].mean()) / full)
                if time_sequences:
                    row.update(_sequence_ms(offsets, lens, cp, name, params))
                rows.append(row)
    return {"rows": rows, "price_tokens": price_tokens, "model": spec_model.as_dict(),
            "targets": quality_targets(rows)}


def _sequence_ms(offsets: np.ndarray, lens: np.ndarray, cp: int, name: str, params: dict) -> dict:
    """CPU milliseconds to plan each sequence alone (one ``planning.plan_flat`` call per row, compiled and warm)."""
    from flashcp.planner.planning import plan_flat
    from flashcp.planner.registry import get_strategy

    strategy = get_strategy(name)
    one = np.zeros(2, np.int64)
    spent = []
    for i in range(offsets.size - 1):
        row = np.ascontiguousarray(lens[offsets[i]:offsets[i + 1]])
        one[1] = row.size
        began = time.thread_time()
        plan_flat(strategy, one, row, cp, params)
        spent.append(1e3 * (time.thread_time() - began))
    ms = np.array(spent)
    return {"plan_ms_p50": float(np.median(ms)), "plan_ms_p99": float(np.percentile(ms, 99)),
            "plan_ms_max": float(ms.max())}


def quality_targets(rows: list[dict]) -> list[dict]:
    """The default strategy ``flashcp2``'s targets against every other strategy of its (source, cp) row.

    Max imbalance within its ceiling (``target_imbalance``); receive below ``magi``, ``ptrr``, ``flashcp`` and
    ``flashcp+``; projected step time at or below every other strategy's; receive at most a share
    (``TARGET_CUTS``) of ``flashcp+``'s.
    """
    by = {(r["source"], r["cp"], r["strategy"]): r for r in rows}
    targets = []

    def add(met: bool, text: str) -> None:
        targets.append({"met": bool(met), "target": text})

    for (source, cp, strategy), r in sorted(by.items()):
        if strategy != "flashcp2":
            continue
        ceiling = r["params"]["target_imbalance"]
        add(r["imbalance_max"] <= ceiling + 1e-12,
            f"{source} cp{cp} flashcp2 max imbalance {r['imbalance_max']:.4f} <= its ceiling {ceiling}")
        for (other_source, other_cp, other), o in sorted(by.items()):
            if (other_source, other_cp) != (source, cp) or other == strategy:
                continue
            if other in ("magi", "ptrr", "flashcp", "flashcp+"):
                add(r["received_pct"] < o["received_pct"], f"{source} cp{cp} receive {r['received_pct']:.1f}% < "
                    f"{other} {o['received_pct']:.1f}%")
            mine, theirs = np.array(r["step_ms_all"]), np.array(o["step_ms_all"])
            slower = int((mine > theirs * (1 + 1e-12)).sum())
            add(r["step_ms"] <= o["step_ms"], f"{source} cp{cp} step {r['step_ms']:.3f} ms <= {other} "
                f"{o['step_ms']:.3f} ms (slower on {slower} of {mine.size} sequences)")
        plus = by.get((source, cp, "flashcp+"))
        factor = TARGET_CUTS.get(cp, {}).get(source)
        if plus and factor:
            add(r["received_pct"] <= factor * plus["received_pct"], f"{source} cp{cp} receive "
                f"{r['received_pct']:.1f}% <= {factor} x flashcp+ {plus['received_pct']:.1f}% = "
                f"{factor * plus['received_pct']:.1f}%")
    return targets
