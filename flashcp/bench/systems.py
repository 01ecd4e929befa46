"""The systems the bench compares (a sharding strategy plus a way to move K/V), and planning for them.

The paper's Figure 5 compares five CP systems; flashcp runs each of them with its own planner and runtime:

| label | strategy | comm | overlap |
| --- | --- | --- | --- |
| Llama3 CP | ``llama3`` | ``full`` (full-KV all-gather) | no |
| Per-Doc CP | ``perdoc`` | ``full`` | no |
| Ring-Attn | ``ring`` (contiguous chunks) | ``ring`` (point-to-point, step by step) | per step |
| Ring-Attn (zigzag) | ``perdoc`` | ``ring`` | per step |
| FlashCP | ``flashcp`` | ``allgather`` (paper Eq. 5, compacted) | no |

plus ours: the improved strategy of the registry with ``auto`` comm (exact-need all-to-all or compacted
all-gather, whichever moves less) and local shards computed while the exchange is in flight. The paper's
figures stack communication on top of compute for the collective-based systems, so those run without
overlap here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from flashcp.planner.plan import SequencePlan

__all__ = ["PAPER_STRATEGIES", "PlanBook", "System", "available_strategies", "default_systems",
           "improved_strategy", "plan_for"]

PAPER_STRATEGIES = ("llama3", "perdoc", "flashcp")
"""The strategies the paper defines (docs/DESIGN.md section 3)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class System:
    """One CP system: how a sequence is sharded and how K/V moves."""

    label: str
    """Name in tables and charts."""
    strategy: str
    """Planner strategy (``ring`` is ``flashcp.planner.strategies.baselines.ring_plan``)."""
    comm: str
    """``full``, ``allgather``, ``a2a``, ``auto`` or ``ring``."""
    overlap: bool
    """Whether local shards compute while the exchange is in flight."""
    ours: bool = False
    """True for the improved system beyond the paper."""

    @property
    def key(self) -> str:
        """``strategy/comm``, unique per system."""
        return f"{self.strategy}/{self.comm}"


def available_strategies() -> list[str]:
    """Registry strategy names in registry order (``ring`` among them).

    Strategies planned in Python (``dcp``, seconds per sequence) are left out: name them in ``--strategies``.
    """
    from flashcp.planner.registry import STRATEGIES

    return [name for name, entry in STRATEGIES.items() if entry.rows is None]


def improved_strategy() -> str | None:
    """The improved strategy the bench runs as "ours", or None.

    The planner's default when it is beyond the paper's three (``flashcp2``), else the first registry
    strategy beyond them (e.g. ``flashcp+``).
    """
    from flashcp.planner.registry import DEFAULT_STRATEGY

    names = available_strategies()
    if DEFAULT_STRATEGY in names and DEFAULT_STRATEGY not in PAPER_STRATEGIES:
        return DEFAULT_STRATEGY
    return next((s for s in names if s not in PAPER_STRATEGIES and s != "ring"), None)


def default_systems() -> tuple[list[System], list[str]]:
    """The paper's five systems plus ours; and a note when the registry has no improved strategy."""
    improved = improved_strategy()
    systems = [
        System(label="Llama3 CP", strategy="llama3", comm="full", overlap=False),
        System(label="Per-Doc CP", strategy="perdoc", comm="full", overlap=False),
        System(label="Ring-Attn", strategy="ring", comm="ring", overlap=True),
        System(label="Ring-Attn (zigzag)", strategy="perdoc", comm="ring", overlap=True),
        System(label="FlashCP", strategy="flashcp", comm="allgather", overlap=False),
    ]
    if improved is not None:
        systems.append(System(label=f"{improved} + auto comm + overlap (ours)", strategy=improved, comm="auto",
                              overlap=True, ours=True))
    notes = [] if improved is not None else ["no improved strategy beyond llama3/perdoc/flashcp is registered"]
    return systems, notes


def plan_for(strategy: str, doc_lens: np.ndarray, cp: int) -> SequencePlan:
    """Plan one sequence with ``strategy`` (a registry name or ``ring``), default parameters."""
    if strategy == "ring":
        from flashcp.planner.strategies.baselines import ring_plan

        return ring_plan(doc_lens, cp)
    from flashcp.planner.planning import plan_sequence

    return plan_sequence(strategy, doc_lens, cp)


class PlanBook:
    """Packed sequences and their plans, made once per (source, context length) and shared by scenarios.

    ``seed`` fixes the sequences: every scenario, and every run with the same seed, plans the same ones.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._sequences: dict = {}
        self._plans: dict = {}
        self.plan_seconds: dict = {}
        """(source label, context_len, strategy, cp) -> seconds spent planning those sequences."""

    def sequences(self, source, num_seqs: int, context_len: int) -> list[np.ndarray]:
        """The first ``num_seqs`` sequences of ``source`` (a SequenceSource) at ``context_len`` tokens."""
        key = (source.label, context_len)
        have = self._sequences.get(key, [])
        if len(have) < num_seqs:
            have = source.sequences(num_seqs, context_len, self.seed)
            self._sequences[key] = have
        return have[:num_seqs]

    def plans(self, source, num_seqs: int, context_len: int, strategy: str, cp: int) -> list[SequencePlan]:
        """Plans of ``sequences(source, num_seqs, context_len)`` with ``strategy`` over ``cp`` ranks."""
        key = (source.label, context_len, strategy, cp)
        have = self._plans.get(key, [])
        sequences = self.sequences(source, num_seqs, context_len)
        if len(have) < len(sequences):
            started = time.perf_counter()
            have = have + [plan_for(strategy, doc_lens, cp) for doc_lens in sequences[len(have):]]
            self.plan_seconds[key] = self.plan_seconds.get(key, 0.0) + time.perf_counter() - started
            self._plans[key] = have
        return have[:len(sequences)]
