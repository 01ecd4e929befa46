"""The strategy registry: one entry per strategy (its kernel, the parameters the kernel takes, its defaults).

Adding a strategy is a kernel module under ``flashcp.planner.strategies`` and one ``Strategy`` entry here (or
``register`` from outside the package); ``flashcp.planner.planning`` and every command find it by name. The
rules of each strategy are in ``flashcp.planner.strategies``, the rules of their parameters in
``flashcp.planner.params``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core.dispatcher import Dispatcher
from numba.core.errors import NumbaError

from flashcp.planner import batch
from flashcp.planner.batch import KERNEL_PARAMS
from flashcp.planner.params import kernel_args, resolve_params
from flashcp.planner.strategies.baselines import llama3_kernel, perdoc_kernel, ring_kernel
from flashcp.planner.strategies.dcp import MISSING, dcp_available, dcp_rows
from flashcp.planner.strategies.flashcp import flashcp_kernel
from flashcp.planner.strategies.flashcp2 import flashcp2_kernel
from flashcp.planner.strategies.flashcp_plus import flashcp_plus_kernel
from flashcp.planner.strategies.peers import magi_kernel, ptrr_kernel

__all__ = ["DEFAULT_STRATEGY", "STRATEGIES", "Strategy", "get_strategy", "register"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
"""A strategy name: it becomes part of a plan folder's name (``cp8-<name>``)."""
_KERNEL_TYPES = {"lens": types.Array(types.int64, 1, "C"), "cp": types.int64, "target": types.float64,
                 "chunk": types.int64, "effort": types.int64, "model": types.Array(types.float64, 1, "C"),
                 "slack": types.float64}
"""The numba type of each argument a kernel receives from the batch planner (``batch.KERNEL_PARAMS``)."""

DEFAULT_STRATEGY = "flashcp2"
"""What ``flashcp plan`` uses unless told otherwise."""


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
             description="portfolio + local search under the projected step time, never slower than its peers"),
)}


def register(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to the registry; ValueError if its name is taken.

    Every function that takes a strategy name (``planning.plan_sequence``, ``pipeline.plan_dataset``, the bench) then
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
    if strategy.kernel is None or numba.config.DISABLE_JIT:  # type: ignore[attr-defined]  # set at import
        return
    names = ("lens", "cp", *strategy.kernel_params)
    arg_types = tuple(_KERNEL_TYPES[name] for name in names)
    call = f"kernel({', '.join(f'{name}: {_KERNEL_TYPES[name]}' for name in names)})"
    try:
        kernel: Any = strategy.kernel  # a numba Dispatcher (__post_init__ checks it); numba ships no types
        kernel.compile(arg_types)
        returned = kernel.overloads[arg_types].signature.return_type
    except (NumbaError, TypeError) as e:
        raise ValueError(f"strategy '{strategy.name}': numba cannot compile its kernel as the planner calls it, "
                         f"{call} ({type(e).__name__}: {_first_cause(e)})") from None
    vector = types.Array(types.int64, 1, "C")
    if not (isinstance(returned, types.BaseTuple) and len(returned) == 4
            and all(isinstance(t, types.Array) and t.dtype == types.int64 and t.ndim == 1
                    for t in returned)):  # type: ignore[attr-defined]  # numba's tuple types iterate
        raise ValueError(f"strategy '{strategy.name}': its {call} returns {returned}, not the four "
                         f"(doc, start, len, rank) {vector} arrays the planner needs")
    try:
        batch.plan_batch(np.array([0, 2], np.int64), np.array([3, 5], np.int64), 2, strategy,
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
