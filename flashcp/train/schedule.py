"""The learning-rate schedule of ``flashcp.train``'s loop: linear warm-up, then constant, cosine or linear decay.

The learning rate of optimizer step ``s`` (1-based) is ``lr * factor(s)``, a pure function of the step number, so
a resumed run that knows how many steps were done (the checkpoint's ``step``) continues the curve exactly; the
checkpoint records the schedule (``LRSchedule.record``) and a resume with another one is refused. With ``W``
warm-up steps, a decay horizon of ``N`` steps and ``r`` the floor ratio:

- ``s <= W``: ``s / W`` (from 0 at step 0 up to 1 at step ``W``);
- after it, with ``p = min((s - W) / (N - W), 1)``: ``constant`` 1, ``linear`` ``r + (1 - r) * (1 - p)``,
  ``cosine`` ``r + (1 - r) * (1 + cos(pi * p)) / 2``; the last step ``N`` trains at ``r * lr``, and any step past
  ``N`` (a run extended on resume) stays there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LR_SCHEDULES", "LRSchedule"]

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True, kw_only=True, slots=True)
class LRSchedule:
    """How the learning rate moves over the optimizer steps (the default: constant, no warm-up)."""

    kind: str = "constant"
    """After the warm-up: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr_ratio``."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to the base learning rate (0: none)."""
    min_lr_ratio: float = 0.0
    """The floor the decay ends at, as a fraction of the base learning rate (in [0, 1])."""
    decay_steps: int | None = None
    """The step at which the decay reaches its floor, warm-up included; None: the run's total steps."""

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown --lr-schedule '{self.kind}' (choose from {', '.join(LR_SCHEDULES)})")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be at least 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ValueError(f"--decay-steps must be at least 1 (or unset: the run's steps), got {self.decay_steps}")

    def horizon(self, total_steps: int) -> int:
        """The step the decay ends at, for a run of ``total_steps`` optimizer steps."""
        return total_steps if self.decay_steps is None else self.decay_steps

    def check(self, total_steps: int) -> None:
        """ValueError (one sentence) when a decaying schedule has no step to decay over in this run."""
        horizon = self.horizon(total_steps)
        if self.kind != "constant" and total_steps > 0 and horizon <= self.warmup_steps:
            raise ValueError(f"--lr-schedule {self.kind} decays after the {self.warmup_steps} warm-up steps but "
                             f"ends at step {horizon}; give more --steps (or --decay-steps) than --warmup-steps")

    def factor(self, step: int, total_steps: int) -> float:
        """The multiplier of the base learning rate at optimizer step ``step`` (1-based) of ``total_steps``."""
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        horizon = self.horizon(total_steps)
        progress = min((step - self.warmup_steps) / max(horizon - self.warmup_steps, 1), 1.0)
        floor = self.min_lr_ratio
        if self.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def record(self, lr: float, total_steps: int) -> dict:
        """What a checkpoint stores: the base learning rate and the schedule.

        The horizon is resolved (None when the schedule does not decay, so a constant run may be extended on
        resume).
        """
        return {"lr": float(lr), "kind": self.kind, "warmup_steps": self.warmup_steps,
                "min_lr_ratio": self.min_lr_ratio,
                "decay_steps": None if self.kind == "constant" else self.horizon(total_steps)}
