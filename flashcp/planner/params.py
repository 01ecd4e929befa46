"""The parameter rules of every strategy: defaults and overrides, topology, model vector, kernel arguments.

A registry entry (``flashcp.planner.registry.Strategy``) names its parameters and their defaults;
``resolve_params`` fills in and checks what a caller overrides, ``kernel_args`` turns the parameters into the
batch kernel's arguments (``batch.KERNEL_PARAMS``), ``check_shape`` refuses a context length or CP size (or
topology) the planner cannot plan. These rules take the entry, never a name: the registry uses them to try a
kernel it registers (``registry.register``), and ``flashcp.planner.planning`` to plan.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flashcp.costmodel.limits import MAX_CONTEXT_LEN, MAX_CP, check_context_len
from flashcp.costmodel.models import ModelSpec
from flashcp.costmodel.shape import AttentionShape

__all__ = ["OBJECTIVES", "SHAPE_PARAMS", "check_shape", "check_topology", "format_topology", "gpus_per_node",
           "kernel_args", "model_params", "objective_model", "parse_topology", "plan_gpus_per_node",
           "resolve_params"]

OBJECTIVES = ("time",)
"""Objectives ``flashcp2`` optimises: ``time`` = the projected step time."""

SHAPE_PARAMS = ("num_heads", "num_kv_heads", "head_dim", "layers")
"""``flashcp2``'s model shape parameters: what ``AttentionShape.from_params`` reads, what a model sets."""


def resolve_params(strategy: Any, target_imbalance: float | None = None, **overrides) -> dict:
    """A registry entry's parameters with ``target_imbalance`` and ``overrides`` filled in (defaults for None).

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
        from flashcp.planner.ilp.polish import parse_effort

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
    from flashcp.costmodel.profile import load_profile

    return load_profile(params["profile"]).gpus_per_node


def check_topology(params: dict, cp: int) -> None:
    """ValueError unless a ``topology`` in ``params`` has exactly ``cp`` ranks (NODES x GPUS == cp)."""
    topology = params.get("topology")
    if topology is not None:
        nodes, gpus = parse_topology(topology)
        if nodes * gpus != cp:
            raise ValueError(f"topology {topology} holds {nodes * gpus} ranks, not the {cp} of --cp {cp}")


def model_params(strategy: Any, overrides: dict, model: ModelSpec) -> dict:
    """``overrides`` with the shape parameters a strategy takes (``SHAPE_PARAMS``) set to ``model``'s shape.

    A plan made for a model is priced for that model alone: a shape parameter given in ``overrides`` that
    differs from the model's is refused (ValueError in one sentence); one equal to it is kept. A strategy
    without shape parameters gets ``overrides`` back unchanged (its prices take the shape apart, ``shape=``).
    """
    shape = model.attention_shape()
    out = dict(overrides)
    for name in SHAPE_PARAMS:
        if name not in strategy.defaults:
            continue
        wanted = getattr(shape, name)
        given = out.get(name)
        if given is not None and given != wanted:
            raise ValueError(f"{strategy.name}'s {name}={given} conflicts with the model {model.name} "
                             f"({name} {wanted}): drop the parameter, or name a model of that shape")
        out[name] = wanted
    return out


def objective_model(params: dict, shape: AttentionShape | None = None) -> np.ndarray:
    """The step-time model vector of ``flashcp2`` parameters (profile file, model shape, topology); cached.

    ``shape``: the shape to price (a model's ``attention_shape()``, its per-token FLOPs included); None: the
    shape parameters in ``params`` (``AttentionShape.from_params``). Do not modify the returned vector.
    """
    from flashcp.costmodel.objective import cached_shape_model

    with_tokens = float(params.get("token_slack", 0.0)) > 0
    shape = AttentionShape.from_params(params) if shape is None else shape
    return cached_shape_model(params.get("profile"), shape, with_tokens, gpus_per_node(params))


def kernel_args(strategy: Any, params: dict, shape: AttentionShape | None = None) -> dict:
    """The batch kernel's ``KERNEL_PARAMS`` (``target``, ``chunk``, ``effort``, ``model``, ``slack``).

    Built from a strategy's parameters; the step-time model (and its profile file) only for a kernel taking
    it, priced for ``shape`` (None: the parameters' own shape, ``objective_model``).
    """
    from flashcp.planner.ilp.polish import parse_effort

    refusal = strategy.missing() if strategy.missing is not None else None
    if refusal:
        raise ValueError(refusal)
    model = objective_model(params, shape) if "model" in strategy.kernel_params else None
    return {"target": float(params.get("target_imbalance", 1.0)), "chunk": int(params.get("chunk_size", 1)),
            "effort": parse_effort(params.get("effort", 0))[0], "model": model,
            "slack": float(params.get("token_slack", 0.0))}


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
