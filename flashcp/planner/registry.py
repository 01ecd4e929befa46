"""The strategy registry, the parameter rules, and planning one sequence by name.

One entry per strategy: its kernel, the parameters the kernel takes, its defaults.

Adding a strategy is a kernel module under ``flashcp.planner.strategies`` and one ``Strategy`` entry here (or
``register`` from outside the package); the batch planner (``flashcp.planner.batch``) and every command find
it by name. The rules of each strategy are in ``flashcp.planner.strategies``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.core.errors import NumbaError

from flashcp.costmodel.limits import MAX_CONTEXT_LEN, MAX_CP, check_context_len
from flashcp.planner import batch
from flashcp.planner.batch import KERNEL_PARAMS
from flashcp.planner.plan import SequencePlan
from flashcp.planner.strategies.baselines import llama3_kernel, perdoc_kernel, ring_kernel
from flashcp.planner.strategies.dcp import MISSING, dcp_available, dcp_rows
from flashcp.planner.strategies.flashcp import flashcp_kernel
from flashcp.planner.strategies.flashcp2 import flashcp2_kernel
from flashcp.planner.strategies.flashcp_plus import flashcp_plus_kernel
from flashcp.planner.strategies.peers import magi_kernel, ptrr_kernel

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "register",
           "get_strategy", "plan_flat", "plan_sequence"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
"""A strategy name: it becomes part of a plan folder's name (``cp8-<name>``)."""
_KERNEL_TYPES = {"lens": types.Array(types.int64, 1, "C"), "cp": types.int64, "target": types.float64,
                 "chunk": types.int64, "effort": types.int64, "model": types.Array(types.float64, 1, "C"),
                 "slack": types.float64}
"""The numba type of each argument a kernel receives from the batch planner (``batch.KERNEL_PARAMS``)."""

DEFAULT_STRATEGY = "flashcp2"
"""What ``flashcp plan`` uses unless told otherwise."""
OBJECTIVES = ("time",)
"""Objectives ``flashcp2`` optimises: ``time`` = the projected step time."""



@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A named sharding strategy."""

    name: str
    """Registry name, used in plan names (``cp8-<name>``); the batch kernel is compiled once per name."""
    defaults: dict
    """Parameters and their defaults (``target_imbalance`` for the flashcp family)."""
    description: str
    """One line for help texts."""
    kernel: Callable | None
    """The per-sequence Numba kernel: ``kernel(lens, cp, *kernel_params) -> (doc, start, len, rank)``."""
    kernel_params: tuple[str, ...] = ()
    """What the kernel takes after ``(lens, cp)``, from ``batch.KERNEL_PARAMS`` (``kernel_args`` builds
    them from the parameters)."""
    rows: Callable | None = None
    """A strategy planned in Python instead (``dcp``: a C++ partitioner behind a Python binding):
    ``rows(row_offsets, doc_lens, cp, params)`` returns what ``batch.plan_batch`` returns; ``kernel`` is
    then None."""
    missing: Callable[[], str | None] | None = None
    """A check run before planning: the sentence refusing the strategy (a missing package), or None."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"a strategy name must be letters, digits and . _ + - (it names plan folders, "
                             f"cp8-<name>), starting with a letter or digit, got {self.name!r}")
        unknown = [name for name in self.kernel_params if name not in KERNEL_PARAMS]
        if unknown or (self.kernel is None) == (self.rows is None):
            raise ValueError(f"strategy '{self.name}' needs a kernel or rows (not both) and kernel parameters "
                             f"from {', '.join(KERNEL_PARAMS)}, got {', '.join(unknown) or 'neither or both'}")
        if self.kernel is not None and not numba.config.DISABLE_JIT and not isinstance(self.kernel, Dispatcher):
            raise ValueError(f"strategy '{self.name}' needs a Numba kernel (decorated with flashcp._numba.njit), "
                             f"got {type(self.kernel).__name__} {getattr(self.kernel, '__name__', '')!r}")

    @property
    def built_in(self) -> bool:
        """Whether this is one of flashcp's own registry entries: only their batch kernels are cached on disk.

        The cache names a compiled batch kernel by the strategy's name, and its key hashes this module, so
        the kernel a built-in name links is always the one cached. A strategy added by ``register`` (even one
        reusing a flashcp kernel) compiles in memory: another process may give its name another kernel.
        """
        return _BUILT_IN.get(self.name) is self

    def plan(self, doc_lens, cp: int, *, target_imbalance: float | None = None, **overrides) -> SequencePlan:
        """Plan one packed sequence: ``doc_lens`` (num_docs,) positive integers -> SequencePlan.

        ``overrides`` set other parameters of the strategy (``chunk_size``, ``effort``, ``profile``, ...).
        """
        params = resolve_params(self, target_imbalance, **overrides)
        lens = np.ascontiguousarray(doc_lens, dtype=np.int64)
        if lens.ndim != 1 or lens.size == 0 or (lens <= 0).any():
            raise ValueError("doc_lens must be a non-empty 1-D array of positive lengths")
        check_shape(int(lens.sum()), cp, params)
        doc, start, length, rank = run_kernel(self, lens, cp, params)
        return SequencePlan(shard_doc=doc, shard_start=start, shard_len=length, shard_rank=rank, cp=cp)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy(name="llama3", defaults={}, kernel=llama3_kernel,
             description="2N equal chunks of the whole sequence, zigzag over ranks"),
    Strategy(name="perdoc", defaults={}, kernel=perdoc_kernel,
             description="every document in 2N chunks, zigzag over ranks"),
    Strategy(name="flashcp", defaults={"target_imbalance": 1.05}, kernel=flashcp_kernel, kernel_params=("target",),
             description="the paper's Algorithm 1: whole docs, Whole-Doc heads, Per-Doc for the longest"),
    Strategy(name="flashcp+", defaults={"target_imbalance": 1.01}, kernel=flashcp_plus_kernel,
             kernel_params=("target",),
             description="Algorithm 1 + tail-anchored splits, token-aware greedy, levers, window swaps"),
    Strategy(name="ring", defaults={}, kernel=ring_kernel,
             description="N contiguous equal chunks, chunk i on rank i (the Ring-Attn layout)"),
    Strategy(name="magi", defaults={"chunk_size": 512}, kernel=magi_kernel, kernel_params=("chunk",),
             description="MagiAttention's MinHeap dispatch of chunk_size-token chunks"),
    Strategy(name="ptrr", defaults={"chunk_size": 128}, kernel=ptrr_kernel, kernel_params=("chunk",),
             description="PyTorch's PTRR load balancer: blocks by process time, dealt in snake order"),
    Strategy(name="dcp", defaults={"chunk_size": 512}, kernel=None, kernel_params=("chunk",), rows=dcp_rows,
             missing=lambda: None if dcp_available() else MISSING,
             description="DCP's hypergraph partitioning of blocks (needs pip install 'flashcp[hypergraph]')"),
    Strategy(name="flashcp2",
             defaults={"target_imbalance": 1.05, "effort": 1, "objective": "time", "profile": None,
                       "num_heads": 32, "num_kv_heads": 32, "head_dim": 128, "layers": 1, "token_slack": 0.0,
                       "topology": None},
             kernel=flashcp2_kernel, kernel_params=("target", "effort", "model", "slack"),
             description="portfolio + local search under the projected step time, never slower than flashcp+"),
)}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry; ValueError if its name is taken.

    Every function that takes a strategy name (``plan_sequence``, ``pipeline.plan_dataset``, the bench) then
    finds it. Its batch kernel is compiled in memory, once per process (``Strategy.built_in`` says why).
    """
    if strategy.name in STRATEGIES:
        raise ValueError(f"a strategy named '{strategy.name}' is already registered")
    STRATEGIES[strategy.name] = strategy
    try:
        _try_kernel(strategy)
    except BaseException:
        del STRATEGIES[strategy.name]
        raise
    return strategy


def _try_kernel(strategy: Strategy) -> None:
    """Type ``strategy``'s kernel as the batch planner calls it, then plan a two-document sequence with it.

    ValueError in one sentence if either fails: a kernel numba cannot type with the planner's arguments would
    otherwise fail at plan time with a page of typing errors.
    """
    if strategy.kernel is None or numba.config.DISABLE_JIT:
        return
    names = ("lens", "cp", *strategy.kernel_params)
    arg_types = tuple(_KERNEL_TYPES[name] for name in names)
    call = f"kernel({', '.join(f'{name}: {_KERNEL_TYPES[name]}' for name in names)})"
    try:
        strategy.kernel.compile(arg_types)
        returned = strategy.kernel.overloads[arg_types].signature.return_type
    except (NumbaError, TypeError) as e:
        raise ValueError(f"strategy '{strategy.name}': numba cannot compile its kernel as the planner calls it, "
                         f"{call} ({type(e).__name__}: {_first_cause(e)})") from None
    vector = types.Array(types.int64, 1, "C")
    if not (isinstance(returned, types.BaseTuple) and len(returned) == 4
            and all(isinstance(t, types.Array) and t.dtype == types.int64 and t.ndim == 1 for t in returned)):
        raise ValueError(f"strategy '{strategy.name}': its {call} returns {returned}, not the four "
                         f"(doc, start, len, rank) {vector} arrays the planner needs")
    try:
        batch.plan_batch(np.array([0, 2], np.int64), np.array([3, 5], np.int64), 2, strategy.name,
                         **kernel_args(strategy, resolve_params(strategy)))
    except Exception as e:  # it compiles but fails on the simplest input
        raise ValueError(f"strategy '{strategy.name}': its kernel fails on a sequence of two documents (3 and 5 "
                         f"tokens) on 2 ranks ({type(e).__name__}: {_first_cause(e)})") from None


def _first_cause(error: Exception) -> str:
    """The first line of numba's message that says what went wrong (its pipeline headers and colours off)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()]
    useful = [line for line in lines if line and not line.startswith("Failed in ")]
    return (useful or lines or [""])[0][:200]


_BUILT_IN = dict(STRATEGIES)
"""flashcp's own entries (``Strategy.built_in``)."""


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; ValueError naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy '{name}': choose one of {', '.join(STRATEGIES)}") from None


def resolve_params(strategy: Strategy, target_imbalance: float | None = None, **overrides) -> dict:
    """The strategy's parameters with ``target_imbalance`` and ``overrides`` filled in (defaults for None).

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


def objective_model(params: dict) -> np.ndarray:
    """The step-time model vector of ``flashcp2`` parameters (profile file, model shape, topology); cached."""
    from flashcp.costmodel.objective import cached_model

    return cached_model(params.get("profile"), int(params.get("num_heads", 32)),
                        int(params.get("num_kv_heads", 32)), int(params.get("head_dim", 128)),
                        int(params.get("layers", 1)), float(params.get("token_slack", 0.0)) > 0,
                        gpus_per_node(params))


def kernel_args(strategy: Strategy, params: dict) -> dict:
    """The batch kernel's ``KERNEL_PARAMS`` (``target``, ``chunk``, ``effort``, ``model``, ``slack``).

    Built from a strategy's parameters; the step-time model (and its profile file) only for a kernel taking it.
    """
    from flashcp.planner.ilp.polish import parse_effort

    refusal = strategy.missing() if strategy.missing is not None else None
    if refusal:
        raise ValueError(refusal)
    model = objective_model(params) if "model" in strategy.kernel_params else None
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


def run_kernel(strategy: Strategy, lens: np.ndarray, cp: int, params: dict):
    """Plan contiguous int64 ``lens`` as one row of ``plan_flat``; returns the four shard arrays."""
    return plan_flat(strategy, np.array([0, lens.size], np.int64), lens, cp, params)[1:]


def plan_flat(strategy: Strategy, row_offsets: np.ndarray, doc_lens: np.ndarray, cp: int, params: dict):
    """Plan every row of flat contiguous int64 ``(row_offsets, doc_lens)``: the one planning path.

    The strategy's batch kernel (or its Python ``rows``), then, for ``effort="ilp[:SECONDS]"``, the CP-SAT
    polish of every row. Returns ``(shard_offsets, doc, start, len, rank)``; not validated
    (``pipeline.plan_rows`` validates, ``Strategy.plan`` builds a ``SequencePlan``, which checks itself).
    """
    from flashcp.planner.ilp.polish import parse_effort, polish_rows

    args = kernel_args(strategy, params)
    if strategy.rows is not None:  # planned in Python (dcp)
        planned = strategy.rows(row_offsets, doc_lens, cp, params)
    else:
        planned = batch.plan_batch(row_offsets, doc_lens, cp, strategy.name, **args)
    seconds = parse_effort(params["effort"])[1] if "effort" in params else None
    if seconds is not None:
        planned = polish_rows(row_offsets, doc_lens, cp, args["model"], seconds, *planned)
    return planned


def plan_sequence(strategy: str, doc_lens, cp: int, *, target_imbalance: float | None = None,
                  **overrides) -> SequencePlan:
    """Plan one packed sequence with the named strategy.

    ``doc_lens``: (num_docs,) positive integers; ``target_imbalance`` and ``overrides`` (``chunk_size``,
    ``effort``, ...) default to the strategy's own. Raises ValueError for an unknown strategy or bad input.
    """
    return get_strategy(strategy).plan(doc_lens, cp, target_imbalance=target_imbalance, **overrides)
