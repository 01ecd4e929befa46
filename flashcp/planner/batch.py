"""The batch planner: plan many sequences in one call, the one entry point of every strategy's kernel.

Sequences come as flat arrays: ``row_offsets`` (rows + 1,) indexes ``doc_lens`` by row. Plans come back the
same way: ``shard_offsets`` (rows + 1,) indexes the flat shard arrays.

``plan_batch`` compiles the batch loop once per strategy, into one function holding that strategy's kernel,
taken from the registry entry it is handed (``flashcp.planner.registry.Strategy``: its ``kernel`` and
``kernel_params``; this module never looks a name up, so the registry can use it): a first
``flashcp plan --strategy flashcp`` does not compile ``flashcp2``. Each strategy's loop is a copy of
``_batch_loop`` whose ``_plan_one`` calls that kernel, cached on disk under the strategy's name (flashcp's own
entries) or compiled in memory (strategies added by ``registry.register``).

Why one function per strategy, with the kernel's code inlined into it: numba compiles every function it calls
into a library of its own, optimises it together with everything that library links, and makes machine code of
the whole; a caller's library then links and optimises all of it again. A loop that called the kernel through
one more function (a dispatch on the strategy's name) optimised and emitted ``flashcp2``'s whole portfolio three
times (loop, dispatch, kernel), about 8 s of a first ``flashcp plan``'s CPU time; inlined, once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import FunctionType
from typing import Any

import numpy as np
from numba import typeof, types

from flashcp._numba import njit
from flashcp.planner.check import check_batch
from flashcp.planner.strategies.pieces import new_pieces

KERNEL_PARAMS = ("target", "chunk", "effort", "model", "slack")
"""What ``plan_batch`` passes on, in this order; a strategy's kernel takes ``(lens, cp)`` and the ones its
registry entry names (``Strategy.kernel_params``)."""


def _call(kernel: Any, params: tuple[str, ...]) -> Callable:
    """``(lens, cp, *KERNEL_PARAMS) -> kernel(lens, cp, *params)``.

    How a kernel taking ``params`` (any of ``KERNEL_PARAMS``, in the entry's order) is called from the batch loop.
    """
    source = (f"def call(lens, cp, {', '.join(KERNEL_PARAMS)}):\n"
              f"    return kernel(lens, cp{''.join(', ' + name for name in params)})\n")
    namespace = {"kernel": kernel}
    exec(source, namespace)  # noqa: S102 -- a fixed template over registry names checked by Strategy
    return namespace["call"]


def _plan_one(lens, cp, target, chunk, effort, model, slack):
    """Plan one sequence: each strategy's copy of ``_batch_loop`` calls its kernel here instead."""
    raise NotImplementedError("replaced in each strategy's batch loop")


_VECTOR = typeof(np.zeros(1, np.int64))

_SIGNATURE = (_VECTOR, _VECTOR, types.int64, types.float64, types.int64, types.int64, typeof(np.zeros(1, np.float64)),
              types.float64)
"""The batch loop's argument types, as ``plan_batch`` calls it."""


def needs_compile(strategy: Any) -> bool:
    """Whether planning with ``strategy`` (a registry entry) has to compile kernels (no cached machine code yet).

    Reads numba's cache index; answers False when it cannot tell.
    """
    try:
        wanted: list[tuple[Any, tuple]] = [(_dispatcher(strategy), _SIGNATURE),
                                           (check_batch, (_VECTOR,) * 7 + (types.int64, types.float64))]
        for dispatcher, signature in wanted:
            cache = dispatcher._cache
            key = cache._index_key(signature, dispatcher.targetctx.codegen())
            if signature not in dispatcher.overloads and key not in cache._cache_file._load_index():
                return True
    except Exception:  # numba internals moved, or no kernel to compile: say nothing rather than something wrong
        return False
    return False


@njit(cache=True)
def _grown(values, size, capacity):
    out = np.empty(capacity, np.int64)
    for i in range(size):
        out[i] = values[i]
    return out


@njit(cache=True)
def _append(out, size, values):
    for i in range(values.shape[0]):
        out[size + i] = values[i]


_compiled: dict[str, tuple[Any, Any, Any]] = {}
"""Per strategy name: its registry entry, its batch loop and, once compiled, the loop's entry point."""

_NO_MODEL = np.zeros(1, np.float64)


def plan_batch(row_offsets, doc_lens, cp, strategy: Any, target: float = 1.0, chunk: int = 1, effort: int = 0,
               model: np.ndarray | None = None, slack: float = 0.0):
    """Plan every row with ``strategy`` (a registry entry); returns (shard_offsets, doc, start, len, rank).

    ``row_offsets`` and ``doc_lens`` are contiguous int64 arrays; ``target`` .. ``slack`` are the strategy's
    kernel parameters (``KERNEL_PARAMS``; those it does not take are ignored). The compiled loop is called
    through its entry point once it is loaded, which skips numba's dispatch on the argument types.
    """
    args = (int(cp), float(target), int(chunk), int(effort), _NO_MODEL if model is None else model, float(slack))
    dispatcher = _dispatcher(strategy)
    entry, _, entry_point = _compiled[strategy.name]
    if entry_point is None or not _plain_int64(row_offsets) or not _plain_int64(doc_lens):
        result = dispatcher(row_offsets, doc_lens, *args)
        compiled = getattr(dispatcher, "overloads", {}).get(_SIGNATURE)  # none under NUMBA_DISABLE_JIT
        if compiled is not None:
            _compiled[strategy.name] = (entry, dispatcher, compiled.entry_point)
        return result
    return entry_point(row_offsets, doc_lens, *args)


def _dispatcher(entry: Any) -> Any:
    """The batch loop of the registry entry ``entry`` (made on first use, again when the entry of its name changed).

    flashcp's own entries inline their kernel and are cached on disk under the strategy's name; the kernel
    cache key covers flashcp's sources only, so a strategy registered at run time, whose name may link another
    kernel in another process (``Strategy.built_in``), calls its kernel from a loop compiled in memory.
    """
    strategy = entry.name
    known = _compiled.get(strategy)
    if known is not None and known[0] is entry:
        return known[1]
    if entry.kernel is None:
        raise ValueError(f"strategy '{strategy}' has no kernel: it plans in Python")
    built_in = entry.built_in
    namespace = dict(globals())
    namespace["_plan_one"] = njit(cache=False, inline="always")(
        _call(_inlined(entry.kernel) if built_in else entry.kernel, entry.kernel_params))
    loop = FunctionType(_batch_loop.__code__, namespace, "_batch_loop")
    loop.__qualname__ = f"_batch_loop.{strategy}"  # names the loop's cache files
    dispatcher = njit(cache=built_in)(loop)
    _compiled[strategy] = (entry, dispatcher, None)
    return dispatcher


_inlined_kernels: dict[Any, Any] = {}


def _inlined(kernel: Any) -> Any:
    """``kernel`` as a function numba inlines into its caller (compiled there, never alone)."""
    if kernel not in _inlined_kernels:
        _inlined_kernels[kernel] = njit(cache=False, inline="always")(kernel.py_func)
    return _inlined_kernels[kernel]


def _plain_int64(values) -> bool:
    return isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1 \
        and values.flags.c_contiguous and values.flags.aligned


def _batch_loop(row_offsets, doc_lens, cp, target, chunk, effort, model, slack):
    rows = row_offsets.shape[0] - 1
    shard_offsets = np.zeros(rows + 1, np.int64)
    capacity = 2 * doc_lens.shape[0] + 4 * cp * rows + 16
    out_doc, out_start, out_len, out_rank = new_pieces(capacity)
    size = 0
    for row in range(rows):
        lens = np.ascontiguousarray(doc_lens[row_offsets[row]:row_offsets[row + 1]])
        doc, start, length, rank = _plan_one(lens, cp, target, chunk, effort, model, slack)
        m = doc.shape[0]
        if size + m > capacity:
            # grow by the shards per row seen so far, projected over the remaining rows
            capacity = max(2 * capacity, size + m, (size + m) * rows // (row + 1) + 16)
            out_doc = _grown(out_doc, size, capacity)
            out_start = _grown(out_start, size, capacity)
            out_len = _grown(out_len, size, capacity)
            out_rank = _grown(out_rank, size, capacity)
        _append(out_doc, size, doc)
        _append(out_start, size, start)
        _append(out_len, size, length)
        _append(out_rank, size, rank)
        size += m
        shard_offsets[row + 1] = size
    return shard_offsets, out_doc[:size], out_start[:size], out_len[:size], out_rank[:size]
