"""The attention throughput curve: achieved TFLOP/s by sequence length, on the curve's logarithms, in Numba.

A ``HardwareProfile`` holds the curve's points (``profile.log_curve`` gives their logarithms); the objective
(``flashcp.costmodel.objective``) and the profile (``HardwareProfile.attention_tflops``) read it through these
kernels, so neither imports the other. Log-log interpolation; below the first knot the first segment's power
law continues, above the last the last value holds; never above the dense peak.
"""

from __future__ import annotations

import math

import numpy as np

from flashcp._numba import njit

__all__ = ["curve_at_length", "curve_on_segment", "curve_segment", "curve_tflops"]


@njit(cache=True)
def curve_segment(x, knots):
    """Which piece of the curve ``x`` falls on.

    -1 before the first knot, k - 1 at or after the last, else j with ``knots[j] <= x < knots[j + 1]``.
    """
    k = knots.shape[0]
    if x < knots[0]:
        return -1
    if x >= knots[k - 1]:
        return k - 1
    j = 0
    while knots[j + 1] <= x:
        j += 1
    return j


@njit(cache=True)
def curve_on_segment(x, j, knots, values, peak):
    """The curve at ``x`` (a log length) on piece ``j`` (``curve_segment``), TFLOP/s."""
    k = knots.shape[0]
    if j < 0:
        if k > 1:
            y = values[0] + (values[1] - values[0]) / (knots[1] - knots[0]) * (x - knots[0])
        else:
            y = values[0]
    elif j == k - 1:
        y = values[k - 1]
    else:
        # np.interp's own formula (slope times offset plus left value), without its set-up per call
        y = (values[j + 1] - values[j]) / (knots[j + 1] - knots[j]) * (x - knots[j]) + values[j]
    return min(math.exp(y), peak)


@njit(cache=True)
def curve_at_length(length, knots, values, peak):
    """The curve at one sequence ``length`` (tokens, float; below 1 counts as 1), TFLOP/s."""
    x = math.log(max(length, 1.0))
    return curve_on_segment(x, curve_segment(x, knots), knots, values, peak)


@njit(cache=True)
def curve_tflops(lengths, knots, values, peak):
    """Achieved TFLOP/s at each of ``lengths`` (float64 1-D), from the curve's logarithms (knots, values).

    Log-log interpolation; below the first knot the first segment's power law continues, above the last the
    last value holds; never above ``peak``.
    """
    out = np.empty(lengths.shape[0], np.float64)
    for i in range(lengths.shape[0]):
        out[i] = curve_at_length(lengths[i], knots, values, peak)
    return out
