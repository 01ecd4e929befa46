"""DP step balance: which sequences train together in one data-parallel step.

Under data parallelism a step trains ``dp`` sequences at once, one per replica, and waits for the slowest
replica. Packed sequences of equal length differ in cost (attention work grows with the square of each
document's length), so a step's time is set by its *largest* sequence cost. Given the costs of a window of
consecutive sequences of the stream, ``balanced_order`` regroups them so that the sum of each step's largest
cost is as small as it can be: sort by cost and deal consecutive groups of ``dp`` (the sorted partition is
optimal for that sum: the i-th largest step maximum is never below the cost at position ``i * dp`` of the sorted
list, and the sorted partition attains exactly those). The groups are then shuffled, so the window's steps keep
a random order and a step's sequences stay drawn from the whole window.

``step_efficiency`` is what it wins: mean sequence cost over the mean of each step's largest (1.0: every
replica of every step equally busy). Costs come from ``costmodel.objective.sequence_flops`` (the plan's
``seq_cost`` column).
"""

from __future__ import annotations

import numpy as np

__all__ = ["balanced_epoch", "balanced_order", "step_efficiency", "window_order"]


def balanced_order(costs: np.ndarray, dp: int, rng: np.random.Generator | None) -> np.ndarray:
    """The order of a window's sequences that groups them into steps of ``dp`` by cost.

    Args:
        costs: (n,) float64, the window's sequence costs in stream order.
        dp: sequences per step (replicas).
        rng: shuffles the order of the steps; None keeps them from the most costly to the least.

    Returns (n,) int64, a permutation of ``range(n)``: the positions of the window's sequences in their new
    order, ``dp`` after ``dp`` a step. When ``n % dp`` is not 0 the last ``n % dp`` positions (the cheapest
    sequences) are a partial step, kept last: the stream's next sequences complete it.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    by_cost = np.argsort(-costs, kind="stable")  # ties keep stream order: the same on every rank
    full = costs.size // dp
    groups = by_cost[:full * dp].reshape(full, dp)
    if rng is not None:
        groups = groups[rng.permutation(full)]
    return np.concatenate([groups.reshape(-1), by_cost[full * dp:]]).astype(np.int64)


def window_order(costs: np.ndarray, dp: int, *, seed: int, epoch: int, start: int, shuffle: bool) -> np.ndarray:
    """``balanced_order`` of the window at stream position ``start`` of ``epoch``, as ``CPLoader`` groups it.

    Its steps are shuffled from ``(seed, epoch, start)`` (``shuffle``), else the most costly first.
    """
    rng = np.random.default_rng((seed, epoch, start)) if shuffle else None
    return balanced_order(costs, dp, rng)


def balanced_epoch(costs: np.ndarray, dp: int, window: int, *, seed: int, epoch: int = 0,
                   shuffle: bool = True) -> np.ndarray:
    """The balanced order of a whole epoch that starts at position 0 (no sequence taken by a straddling step).

    ``costs`` (n,) in stream order; windows of ``window * dp`` sequences from position 0, each grouped by
    ``window_order``: what ``CPLoader`` with ``balance_window=window`` and ``dp_size=dp`` trains in its first
    epoch. Returns (n,) int64 stream positions in the new order (``arange(n)`` when ``window`` is 0 or ``dp`` 1).
    """
    costs = np.asarray(costs, dtype=np.float64)
    if window == 0 or dp == 1:
        return np.arange(costs.size, dtype=np.int64)
    size = window * dp
    parts = [start + window_order(costs[start:start + size], dp, seed=seed, epoch=epoch, start=start,
                                  shuffle=shuffle) for start in range(0, costs.size, size)]
    return np.concatenate([*parts, np.zeros(0, np.int64)])


def step_efficiency(costs: np.ndarray, dp: int) -> float:
    """Mean sequence cost over the mean of each step's largest, for ``costs`` (n,) in stream order.

    Steps are ``dp`` consecutive sequences; a last partial step is left out. 1.0 for ``dp`` 1.
    """
    costs = np.asarray(costs, dtype=np.float64)
    full = costs.size // dp
    if full == 0:
        return 1.0
    steps = costs[:full * dp].reshape(full, dp)
    return float(steps.mean() / steps.max(axis=1).mean())
