"""Batch kernels: plan many sequences in one call, and check many plans in one call.

Sequences come as flat arrays: ``row_offsets`` (rows + 1,) indexes ``doc_lens`` by row. Plans come back the
same way: ``shard_offsets`` (rows + 1,) indexes the flat shard arrays.

``plan_batch`` is the one entry point of every strategy. It is compiled once per strategy name (a
compile-time literal), and each compilation links only that strategy's kernel, found in the registry
(``flashcp.planner.strategies.STRATEGIES``: its ``kernel`` and ``kernel_params``): a first
``flashcp plan --strategy flashcp`` does not compile ``flashcp2``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import literally, typeof, types
from numba.extending import overload

from flashcp._numba import njit
from flashcp.planner._kernels import _doc_offsets, _quotas, _ratio
from flashcp.planner.cost import _allgather_contributions, _exact_need_received, _order_of, _rank_workloads

# error codes of check_batch; flashcp.planner.pipeline turns them into sentences
OK, NO_SHARDS, BAD_LENGTH, BAD_RANK, BAD_DOC, BAD_COVERAGE, BAD_QUOTA = range(7)

KERNEL_PARAMS = ("target", "chunk", "effort", "model", "slack")
"""What ``plan_batch`` passes on, in this order; a strategy's kernel takes ``(lens, cp)`` and the ones its
registry entry names (``Strategy.kernel_params``)."""

_CALLS: dict[tuple[str, ...], Callable[[Any], Callable]] = {
    (): lambda kernel: lambda lens, cp, strategy, target, chunk, effort, model, slack: kernel(lens, cp),
    ("target",):
        lambda kernel: lambda lens, cp, strategy, target, chunk, effort, model, slack: kernel(lens, cp, target),
    ("chunk",):
        lambda kernel: lambda lens, cp, strategy, target, chunk, effort, model, slack: kernel(lens, cp, chunk),
    ("target", "effort", "model", "slack"):
        lambda kernel: lambda lens, cp, strategy, target, chunk, effort, model, slack: kernel(
            lens, cp, target, effort, model, slack),
}
"""How a kernel is called, by the parameters it takes: a strategy needs a new row here only when its kernel
takes a new combination of ``KERNEL_PARAMS``."""


def _plan_one(lens, cp, strategy, target, chunk, effort, model, slack):
    """Plan one sequence with the named strategy (compiled code only; see ``_plan_one_impl``)."""
    raise NotImplementedError("compiled code only")


@overload(_plan_one)
def _plan_one_impl(lens, cp, strategy, target, chunk, effort, model, slack):
    # Only a literal name is typed, so that a compilation links the one kernel it names. The registry is
    # read at compile time; its module is part of the kernel cache key (flashcp._numba).
    if not isinstance(strategy, types.StringLiteral):
        return None
    from flashcp.planner.strategies import STRATEGIES

    entry = STRATEGIES.get(strategy.literal_value)
    if entry is None:
        return None
    return _CALLS[entry.kernel_params](entry.kernel)


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
        result = _plan_batch(row_offsets, doc_lens, *args)
        signature = next((s for s in _plan_batch.overloads if s[3] == types.literal(strategy)), None)
        if signature is not None and signature[0] == signature[1] == _VECTOR:
            _entry_points[strategy] = _plan_batch.overloads[signature].entry_point
        return result
    return entry(row_offsets, doc_lens, *args)


def _plain_int64(values) -> bool:
    return isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1 \
        and values.flags.c_contiguous and values.flags.aligned


@njit(cache=True)
def _plan_batch(row_offsets, doc_lens, cp, strategy, target, chunk, effort, model, slack):
    rows = row_offsets.shape[0] - 1
    shard_offsets = np.zeros(rows + 1, np.int64)
    capacity = 2 * doc_lens.shape[0] + 4 * cp * rows + 16
    out_doc = np.empty(capacity, np.int64)
    out_start = np.empty(capacity, np.int64)
    out_len = np.empty(capacity, np.int64)
    out_rank = np.empty(capacity, np.int64)
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


@njit(cache=True)
def _check_row(lens, doc, start, length, rank, cp):
    num_shards = doc.shape[0]
    if num_shards == 0:
        return NO_SHARDS
    for i in range(num_shards):
        if length[i] < 1:
            return BAD_LENGTH
        if rank[i] < 0 or rank[i] >= cp:
            return BAD_RANK
        if doc[i] < 0 or doc[i] >= lens.shape[0]:
            return BAD_DOC
        if start[i] < 0 or start[i] + length[i] > lens[doc[i]]:
            return BAD_COVERAGE
    offsets = _doc_offsets(lens)
    position = np.empty(num_shards, np.int64)
    for i in range(num_shards):
        position[i] = offsets[doc[i]] + start[i]
    order = _order_of(position)  # positions are unique in a valid plan; a repeated one fails below either way
    expected = 0
    for j in range(num_shards):
        i = order[j]
        if position[i] != expected:
            return BAD_COVERAGE
        expected += length[i]
    if expected != offsets[-1]:
        return BAD_COVERAGE
    quotas = _quotas(offsets[-1], cp)
    tokens = np.zeros(cp, np.int64)
    for i in range(num_shards):
        tokens[rank[i]] += length[i]
    for r in range(cp):
        if tokens[r] != quotas[r]:
            return BAD_QUOTA
    return OK


@njit(cache=True)
def slack_tokens(share, context_len, cp):
    """Tokens a rank may be off its quota under token slack ``share``: ``floor(share * C / N)``."""
    return np.int64(np.floor(share * context_len / cp))


@njit(cache=True)
def _check_window(lens, length, rank, cp, window):
    """OK when every rank's tokens are within ``window`` of its quota, else BAD_QUOTA."""
    quotas = _quotas(lens.sum(), cp)
    tokens = np.zeros(cp, np.int64)
    for i in range(length.shape[0]):
        tokens[rank[i]] += length[i]
    for q in range(cp):
        if abs(tokens[q] - quotas[q]) > window:
            return BAD_QUOTA
    return OK


@njit(cache=True)
def check_batch(row_offsets, doc_lens, shard_offsets, doc, start, length, rank, cp, slack):
    """Check every row's plan (coverage, equal tokens) and recompute its metrics with the cost model.

    With token ``slack`` > 0 (0.0: exact quotas) a rank may hold ``slack_tokens(slack, C, N)`` tokens more or
    fewer than its quota. Returns (error code per row, imbalance, all-gather critical path, exact-need critical path);
    metrics of a row with an error are left at 0.
    """
    rows = row_offsets.shape[0] - 1
    errors = np.zeros(rows, np.int64)
    imbalance = np.zeros(rows, np.float64)
    ag = np.zeros(rows, np.int64)
    a2a = np.zeros(rows, np.int64)
    for row in range(rows):
        lens = doc_lens[row_offsets[row]:row_offsets[row + 1]]
        lo = shard_offsets[row]
        hi = shard_offsets[row + 1]
        d = doc[lo:hi]
        s = start[lo:hi]
        n = length[lo:hi]
        r = rank[lo:hi]
        errors[row] = _check_row(lens, d, s, n, r, cp)
        if errors[row] == BAD_QUOTA and slack > 0:  # every other check passed; the quotas get the window
            errors[row] = _check_window(lens, n, r, cp, slack_tokens(slack, lens.sum(), cp))
        if errors[row] != OK:
            continue
        work = _rank_workloads(s, n, r, cp)
        imbalance[row] = _ratio(work.max(), work.sum(), cp)
        ag[row] = _allgather_contributions(d, s, r, n, cp).max()
        a2a[row] = _exact_need_received(d, s, n, r, cp).max()
    return errors, imbalance, ag, a2a
