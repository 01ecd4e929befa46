"""Numba kernel of the driver's layout: the packer's loop on lengths alone over a whole shard's documents at once.

``packing.Packer(lengths_only=True)`` (the packer's own loop) is its plain-Python reference: tests compare the
two.
"""

from __future__ import annotations

import numpy as np

from flashcp._numba import njit

FILL, OPEN_STARTS, SPLIT, TRUNCATED, TOKENS_TRUNCATED = range(5)
"""Fields of the packer state array."""


@njit(cache=True)
def lay_out(lens, starts, context_len, truncate, state):
    """Lay documents ``[starts[i], lens[i])`` in order; ``state`` (5,) int64 is updated in place.

    Returns (windows, 5) int64: for every sequence closed, the document (index into ``lens``) that closed it,
    the offset in that document where the next sequence starts (0: at the next document), and the counts
    split, truncated, tokens truncated right after it.
    """
    total = state[FILL]
    for i in range(lens.size):
        total += lens[i] - starts[i]
    out = np.empty((total // context_len + 1, 5), np.int64)
    k = 0
    for i in range(lens.size):
        n, pos = lens[i], starts[i]
        while pos < n:
            take = min(n - pos, context_len - state[FILL])
            if pos == 0:
                state[OPEN_STARTS] += 1
            state[FILL] += take
            piece_start = pos
            pos += take
            if state[FILL] < context_len:
                break
            if pos < n:
                if truncate:
                    state[TRUNCATED] += 1
                    state[TOKENS_TRUNCATED] += n - pos
                    pos = n
                elif piece_start == 0:
                    state[SPLIT] += 1
            out[k, 0] = i
            out[k, 1] = pos if pos < n else 0
            out[k, 2] = state[SPLIT]
            out[k, 3] = state[TRUNCATED]
            out[k, 4] = state[TOKENS_TRUNCATED]
            k += 1
            state[FILL] = 0
            state[OPEN_STARTS] = 0
    return out[:k]
