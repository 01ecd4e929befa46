"""The batch planner: plan many sequences in one call, the one entry point of every strategy's kernel.

Sequences come as flat arrays: ``row_offsets`` (rows + 1,) indexes ``doc_lens`` by row. Plans come back the
same way: ``shard_offsets`` (rows + 1,) indexes the flat shard arrays.

``plan_batch`` is compiled once per strategy name (a compile-time literal), and each compilation links only
that strategy's kernel, found in the registry (``flashcp.planner.registry.STRATEGIES``: its ``kernel`` and
``kernel_params``): a first ``flashcp plan --strategy flashcp`` does not compile ``flashcp2``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import literally, typeof, types
from numba.extending import overload

from flashcp._numba import njit
from flashcp.planner.check import check_batch
from flashcp.planner.strategies.pieces import new_pieces

KERNEL_PARAMS = ("target", "chunk", "effort", "model", "slack")
"""What ``plan_batch`` passes on, in this order; a strategy's kernel takes ``(lens, cp)`` and the ones its
registry entry names (``Strategy.kernel_params``)."""


def _call(kernel: Any, params: tuple[str, ...]) -> Callable:
    """``(lens, cp, strategy, *KERNEL_PARAMS) -> kernel(lens, cp, *params)``.

    How a kernel taking ``params`` (any of ``KERNEL_PARAMS``, in the entry's order) is called from the batch loop.
    """
    source = (f"def call(lens, cp, strategy, {', '.join(KERNEL_PARAMS)}):\n"
              f"    return kernel(lens, cp{''.join(', ' + name for name in params)})\n")
    namespace = {"kernel": kernel}
    exec(source, namespace)  # noqa: S102 -- a fixed template over registry names checked by Strategy
    return namespace["call"]


def _plan_one(lens, cp, strategy, target, chunk, effort, model, slack):
    """Plan one sequence with the named strategy (compiled code only; see ``_plan_one_impl``)."""
    raise NotImplementedError("compiled code only")


@overload(_plan_one)
def _plan_one_impl(lens, cp, strategy, target, chunk, effort, model, slack):
    # Only a literal name is typed, so that a compilation links the one kernel it names. The registry is
    # read at compile time; its module is part of the kernel cache key (flashcp._numba.LINKING_MODULES).
    if not isinstance(strategy, types.StringLiteral):
        return None
    from flashcp.planner.registry import STRATEGIES

    entry = STRATEGIES.get(strategy.literal_value)
    if entry is None:
        return None
    return _call(entry.kernel, entry.kernel_params)


_VECTOR = typeof(np.zeros(1, np.int64))

_SIGNATURE_TAIL = (types.float64, types.int64, types.int64, typeof(np.zeros(1, np.float64)), types.float64)


def needs_compile(strategy: str) -> bool:
    """Whether planning with ``strategy`` has to compile kernels (no cached machine code yet).

    Reads numba's cache index; answers False when it cannot tell.
    """
    wanted: list[tuple[Any, tuple]] = [
        (_plan_batch, (_VECTOR, _VECTOR, types.int64, types.literal(strategy), *_SIGNATURE_TAIL)),
        (check_batch, (_VECTOR,) * 7 + (types.int64, types.float64))]
    try:
        for dispatcher, signature in wanted:
            cache = dispatcher._cache
            key = cache._index_key(signature, dispatcher.targetctx.codegen())
            if signature not in dispatcher.overloads and key not in cache._cache_file._load_index():
                return True
    except Exception:  # numba internals moved: say nothing rather than something wrong
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


_entry_points: dict[str, Callable] = {}

_NO_MODEL = np.zeros(1, np.float64)


def plan_batch(row_offsets, doc_lens, cp, strategy: str, target: float = 1.0, chunk: int = 1, effort: int = 0,
               model: np.ndarray | None = None, slack: float = 0.0):
    """Plan every row with the named strategy; returns (shard_offsets, doc, start, len, rank).

    ``row_offsets`` and ``doc_lens`` are contiguous int64 arrays; ``target`` .. ``slack`` are the strategy's
    kernel parameters (``KERNEL_PARAMS``; those it does not take are ignored). The compiled code of a
    strategy is called directly once it is loaded: numba's own dispatch of a literal argument re-types the
    call (~20 ms).
    """
    args = (int(cp), strategy, float(target), int(chunk), int(effort), _NO_MODEL if model is None else model,
            float(slack))
    entry = _entry_points.get(strategy)
    if entry is None or not _plain_int64(row_offsets) or not _plain_int64(doc_lens):
        dispatcher = _dispatcher(strategy)
        result = dispatcher(row_offsets, doc_lens, *args)
        signature = next((s for s in dispatcher.overloads if s[3] == types.literal(strategy)), None)
        if signature is not None and signature[0] == signature[1] == _VECTOR:
            _entry_points[strategy] = dispatcher.overloads[signature].entry_point
        return result
    return entry(row_offsets, doc_lens, *args)


def _dispatcher(strategy: str) -> Any:
    """The batch loop compiled for ``strategy``: cached on disk for flashcp's own entries, else in memory.

    The kernel cache key covers flashcp's sources only, and the cache names a compilation by the strategy's
    name: a name registered at run time may link another kernel in another process (``Strategy.built_in``).
    """
    from flashcp.planner.registry import STRATEGIES

    entry = STRATEGIES.get(strategy)
    return _plan_batch if entry is None or entry.built_in else _plan_batch_in_memory


def _plain_int64(values) -> bool:
    return isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1 \
        and values.flags.c_contiguous and values.flags.aligned


@njit(cache=True)
def _plan_batch(row_offsets, doc_lens, cp, strategy, target, chunk, effort, model, slack):
    rows = row_offsets.shape[0] - 1
    shard_offsets = np.zeros(rows + 1, np.int64)
    capacity = 2 * doc_lens.shape[0] + 4 * cp * rows + 16
    out_doc, out_start, out_len, out_rank = new_pieces(capacity)
    size = 0
    for row in range(rows):
        lens = np.ascontiguousarray(doc_lens[row_offsets[row]:row_offsets[row + 1]])
        doc, start, length, rank = _plan_one(lens, cp, literally(strategy), target, chunk, effort, model, slack)
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


_plan_batch_in_memory = njit(cache=False)(_plan_batch.py_func)
"""``_plan_batch`` for strategies registered from outside flashcp (``registry.register``)."""
