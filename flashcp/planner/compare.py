"""The comparison of a plan with the baselines on the same sequences, priced by the step-time objective.

``flashcp plan`` compares its plan with ``BASELINES`` on every ``step``-th sequence of the dataset
(``--compare N`` sequences at most, evenly spaced): each baseline planned one sequence at a time and only its
metrics kept, every compared plan priced by the step-time objective (``flashcp.costmodel.objective``, the
model of ``flashcp2`` and ``flashcp bench``). ``compare_rows`` measures a row group's compared rows (in the
pipeline's per-file jobs), ``compare_summary`` makes plan.json's ``baselines`` and ``compare`` of them.
"""

from __future__ import annotations

import numpy as np

from flashcp.costmodel.shape import AttentionShape
from flashcp.planner.params import SHAPE_PARAMS
from flashcp.planner.planning import PlannedRows, plan_rows, summarize
from flashcp.planner.registry import DEFAULT_STRATEGY, get_strategy

__all__ = ["BASELINES", "COMPARE_DEFAULT", "compare_rows", "compare_summary", "compared_names", "joined_metrics",
           "metrics_summary", "step_params"]

BASELINES = ("llama3", "perdoc")
"""What ``flashcp plan`` compares its plan with: Llama3 CP and Per-Doc CP."""
COMPARE_DEFAULT = 256
"""Sequences compared with the baselines by default (``--compare``), evenly spaced over the dataset.

The comparison reports a ratio of mean projected step times. On WLB-LLM lengths its bootstrap standard error
at 256 sequences is 1.6-3.8% (128K x cp 8 and 1M x cp 64; twice that at 64), well inside the gaps it reports
there (1.6x to 3.4x), while it costs 11-21 ms of CPU per sequence at 1M x cp 64 (a Per-Doc plan has 33,000
shards there): a few seconds per run, about a tenth of planning one default 8,192-row file (bench/RESULTS.md).
"""


def step_params(strategy: str, params: dict) -> dict:
    """The objective parameters (profile, model shape) the comparison prices plans with.

    A plan's own for a strategy that minimises the step time (``flashcp2``), else ``flashcp2``'s defaults (the
    bench's H100 profile, one layer of H = H_kv = 32, D = 128), so every row of a comparison has one price. A
    plan made for a model (``flashcp plan --model``) is priced for its shape, given apart (``shape=``).
    """
    if "model" in get_strategy(strategy).kernel_params:
        return params
    return get_strategy(DEFAULT_STRATEGY).defaults


def compared_names(strategy: str) -> list[str]:
    """The strategies a plan of ``strategy`` is compared on: itself first, then the other ``BASELINES``."""
    return [strategy] + [name for name in BASELINES if name != strategy]


def compare_rows(strategy: str, cp: int, offsets: np.ndarray, lens: np.ndarray, planned: PlannedRows,
                 rows: np.ndarray, model: np.ndarray | None, where: str, first: int) -> dict[str, tuple]:
    """(imbalance, all-gather, exact-need, step seconds) of ``rows`` of a row group, per compared strategy.

    ``offsets``, ``lens``: the row group's sequences, ``planned``: their plans by ``strategy``, ``model``: the
    step-time model vector (``step_params``); rows are named ``first`` + their index in ``where``. The plan's
    own rows are priced as planned; each baseline plans one row at a time (a Per-Doc plan of a long sequence
    is large), validated like every plan, and keeps its metrics only. A baseline that is the plan's strategy
    is the plan itself.
    """
    assert model is not None
    own = planned.take(rows)
    out = {strategy: (own.imbalance, own.ag_comm_tokens, own.a2a_comm_tokens, own.step_seconds(cp, model))}
    del own
    for name in BASELINES:
        if name == strategy:
            continue
        values = np.zeros((4, rows.size))
        for j, i in enumerate(rows):
            one_offsets = np.array([0, offsets[i + 1] - offsets[i]], np.int64)
            one = plan_rows(one_offsets, lens[offsets[i]:offsets[i + 1]], cp, name, where=where,
                            first_row=first + int(i))
            values[:, j] = one.imbalance[0], one.ag_comm_tokens[0], one.a2a_comm_tokens[0], \
                one.step_seconds(cp, model)[0]
        out[name] = (values[0], values[1].astype(np.int64), values[2].astype(np.int64), values[3])
    return out


def joined_metrics(parts: list[tuple], width: int) -> tuple:
    """The per-row-group metric tuples of ``parts`` joined into one tuple of ``width`` arrays."""
    if not parts:
        return (np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))[:width]
    return tuple(np.concatenate(column) for column in zip(*parts))


def metrics_summary(parts: list[tuple], context_len: int, cp: int) -> dict:
    """``summarize`` of metric tuples (imbalance, all-gather, exact-need[, step seconds]) joined.

    With step seconds, their mean too (``step_seconds_mean``).
    """
    columns = [np.concatenate(column) for column in zip(*parts)]
    out = summarize(columns[0], columns[1], columns[2], context_len, cp)
    if len(columns) > 3 and columns[0].size:
        out["step_seconds_mean"] = float(columns[3].mean())
    return out


def compare_summary(compared: list[dict[str, tuple]], context_len: int, cp: int, compare: int, step: int,
                    priced_by: dict, shape: AttentionShape | None = None) -> dict:
    """plan.json's ``baselines``, ``baselines_every_nth_sequence`` and ``compare`` of the per-file results.

    ``compared``: every file's ``compare_rows`` metrics joined (strategy name -> metric tuple, the plan's
    strategy first). ``baselines`` (name -> metrics, ``step_seconds_mean`` included) and
    ``baselines_every_nth_sequence`` (0: no comparison); ``compare``: how many sequences were compared, the
    price's profile and model shape (``shape``, else the shape parameters of ``priced_by``; ``layer_kinds``
    the ``(kind, size, count)`` runs priced when some layer is not full attention, ``recurrent`` a hybrid's
    recurrent layers priced beside them), and the plan's own
    metrics on those sequences (``strategy``).
    """
    names = list(compared[0]) if compared else []
    summaries = {name: metrics_summary([c[name] for c in compared], context_len, cp) for name in names}
    out: dict = {"baselines": {name: summaries[name] for name in BASELINES if name in summaries},
                 "baselines_every_nth_sequence": step,
                 "compare": {"requested": compare, "sequences": summaries[names[0]]["sequences"] if names else 0,
                             "every_nth_sequence": step}}
    if names:
        from flashcp.costmodel.profile import load_profile

        out["compare"].update(
            profile=load_profile(priced_by.get("profile")).name,
            model={key: int(getattr(shape, key)) for key in SHAPE_PARAMS} if shape is not None else
            {key: int(priced_by.get(key, default)) for key, default in
             (("num_heads", 32), ("num_kv_heads", 32), ("head_dim", 128), ("layers", 1))},
            strategy=summaries[names[0]])
        if shape is not None and shape.layer_kinds:  # the layers priced by kind (absent: every one full)
            out["compare"]["model"]["layer_kinds"] = [list(run) for run in shape.layer_kinds]
        if shape is not None and shape.recurrent is not None:  # a hybrid's recurrent layers, priced beside them
            out["compare"]["model"]["recurrent"] = shape.as_dict()["recurrent"]
    return out
