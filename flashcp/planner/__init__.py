"""The planner: strategies and their kernels, the batch planner and validator, plan files, verification and the
CP-SAT audit.

Layout: ``registry`` (one entry per strategy), ``params`` (the rules of their parameters), ``strategies/``
(one kernel module per strategy, the rules in its docstring), ``batch`` (the one batch entry point of every
kernel), ``planning`` (the one planning path: ``plan_flat``, ``plan_sequence``, ``plan_rows``), ``check`` (the
plan validator), ``plan`` (``SequencePlan``), ``pipeline`` (plan a dataset: stream, validate, write,
summarise), ``compare`` (the comparison with the baselines), ``plan_reader`` and ``plan_writer`` (plan files),
``verify`` (re-check a dataset and its plans), ``ilp/`` (CP-SAT: blocks, model, receive, audit, polish). The
cost model lives one layer below, in ``flashcp.costmodel``.

The names below load their modules on first use, so that ``import flashcp.planner`` (the runtime reads
``flashcp.planner.plan`` and ``flashcp.planner.plan_reader``) compiles and loads no planning kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "SequencePlan", "Strategy", "get_strategy", "plan_sequence", "register"]

_HOMES = {"SequencePlan": "flashcp.planner.plan", "DEFAULT_STRATEGY": "flashcp.planner.registry",
          "STRATEGIES": "flashcp.planner.registry", "Strategy": "flashcp.planner.registry",
          "get_strategy": "flashcp.planner.registry", "plan_sequence": "flashcp.planner.planning",
          "register": "flashcp.planner.registry"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flashcp.planner' has no attribute '{name}'")
    return getattr(importlib.import_module(home), name)
