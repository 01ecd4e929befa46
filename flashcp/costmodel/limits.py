"""The one size limit of flashcp.

``pack``, ``synth``, ``plan`` and ``bench`` refuse a longer context before any work.
"""

from __future__ import annotations

__all__ = ["MAX_CONTEXT_LEN", "MAX_CP", "check_context_len"]

MAX_CONTEXT_LEN = 1 << 24
"""Longest sequence the kernels accept: keeps every workload sum times ``cp`` inside int64. The one limit of
flashcp: ``pack``, ``synth``, ``plan`` and ``bench`` refuse a longer context before any work."""

MAX_CP = 1 << 12
"""Largest CP size the kernels accept."""


def check_context_len(context_len: int, what: str = "context length") -> None:
    """ValueError when ``context_len`` is above ``MAX_CONTEXT_LEN`` (the same sentence for every command)."""
    if context_len > MAX_CONTEXT_LEN:
        raise ValueError(f"{what} {context_len:,} is above the longest context flashcp plans, "
                         f"{MAX_CONTEXT_LEN:,} tokens (2^24); choose a shorter one")
