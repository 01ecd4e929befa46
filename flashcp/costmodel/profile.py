"""Hardware profiles: the numbers the latency projection runs on, read from a JSON file that cites each one.

A profile file (``flashcp/costmodel/profiles/h100-sxm-nvlink.json`` is the default) holds, each with a
``source`` sentence:

- ``peak_tflops``: dense BF16 tensor-core peak (caps the attention curve);
- ``attention_tflops``: achieved attention throughput by sequence length, forward and backward, as
  ``lengths`` / ``forward`` / ``backward`` lists (TFLOP/s, forward FLOPs ``4 * pairs * H * D``, backward
  2.5x that);
- ``query_tile``: query rows per kernel tile (a shorter shard still pays for a whole tile);
- ``causal_skip``: 1 when the kernel skips the masked part above the causal diagonal, 0 when it computes
  the whole ``queries x (prefix + queries)`` rectangle of a shard (optional, default 1);
- ``link_gbps``: GPU-to-GPU bandwidth per direction (GB/s);
- ``hbm_gbps``: memory bandwidth for the runtime's gathers (GB/s);
- ``kernel_overhead_us``: fixed cost of one attention kernel call;
- ``sequence_overhead_us``: fixed cost of each sequence (shard) inside a call (optional, default 0);
- ``collective_latency_us``: fixed cost of one collective or ring step;
- ``inter_node_gbps``: bandwidth per GPU and direction between nodes (optional, default ``link_gbps``);
- ``gpus_per_node``: CP ranks per node, rank r on node ``r // gpus_per_node`` (optional, default 0: every
  rank in one node); ``flashcp plan --topology NODESxGPUS`` overrides it for one plan.

Every number is checked at load (one sentence naming the file and the field): finite, positive where it
is a rate, curve lengths increasing whole numbers up to the longest context (a curve at 1e30 tokens divided
by zero inside the objective's kernel; an all-NaN or all-Infinity curve priced every plan as NaN or 0).

Defaults come from public specs and published FlashAttention benchmarks; what no spec gives is marked
ASSUMPTION in the file. ``flashcp bench --calibrate`` replaces the attention curve and the overheads with
measurements (``flashcp.bench.calibrate``) and writes a new file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from flashcp.costmodel.curve import curve_tflops
from flashcp.costmodel.limits import MAX_CONTEXT_LEN
from flashcp.errors import FlashcpError

__all__ = ["DEFAULT_PROFILE", "HardwareProfile", "load_profile", "profile_from_json"]

DEFAULT_PROFILE = "h100-sxm-nvlink.json"
"""File name of the default profile inside ``flashcp/costmodel/profiles``."""

PROFILE_FORMAT = "flashcp-hardware-profile"
SCALARS = ("peak_tflops", "query_tile", "link_gbps", "hbm_gbps", "kernel_overhead_us",
           "collective_latency_us")


OPTIONAL = {"sequence_overhead_us": 0.0, "causal_skip": 1.0, "inter_node_gbps": 0.0, "gpus_per_node": 0.0}
"""Parameters a profile file may leave out, with their defaults."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    """One GPU type and its interconnect, as the latency projection sees them."""

    name: str
    """What the profile describes (and whether it was calibrated)."""
    calibrated: bool
    """True when the attention curve and overheads were measured by ``--calibrate``."""
    peak_tflops: float
    """Dense BF16 tensor-core peak, TFLOP/s."""
    lengths: tuple[int, ...]
    """Sequence lengths of the attention curve, increasing."""
    forward_tflops: tuple[float, ...]
    """Achieved forward attention TFLOP/s at each length."""
    backward_tflops: tuple[float, ...]
    """Achieved backward attention TFLOP/s at each length (2.5x forward FLOPs convention)."""
    query_tile: int
    """Query rows per kernel tile."""
    link_gbps: float
    """Bandwidth between two GPUs, per direction, GB/s."""
    hbm_gbps: float
    """Memory bandwidth available to gathers and merges, GB/s."""
    kernel_overhead_us: float
    """Fixed cost of one attention kernel call, microseconds."""
    collective_latency_us: float
    """Fixed cost of one collective or ring step, microseconds."""
    sequence_overhead_us: float = 0.0
    """Fixed cost of each sequence (shard) of a kernel call, microseconds."""
    causal_skip: bool = True
    """Whether the kernel skips the masked pairs above the causal diagonal (else computes the rectangle)."""
    inter_node_gbps: float = 0.0
    """Bandwidth between GPUs of different nodes, per GPU and direction, GB/s (0: ``link_gbps``)."""
    gpus_per_node: int = 0
    """CP ranks per node (rank r on node ``r // gpus_per_node``); 0: every rank in one node."""
    sources: dict = field(default_factory=dict)
    """Parameter name -> citation sentence (or how it was measured)."""

    def __post_init__(self):
        if self.inter_node_gbps == 0:
            object.__setattr__(self, "inter_node_gbps", self.link_gbps)
        if self.gpus_per_node < 0 or self.gpus_per_node != int(self.gpus_per_node):
            raise ValueError(f"gpus_per_node must be a whole number, 0 or more, got {self.gpus_per_node}")
        object.__setattr__(self, "gpus_per_node", int(self.gpus_per_node))
        if not self.lengths or len(self.lengths) != len(self.forward_tflops) or \
                len(self.lengths) != len(self.backward_tflops):
            raise ValueError("attention_tflops needs equally long, non-empty lengths, forward and backward "
                             "lists")
        if any(b <= a for a, b in zip(self.lengths, self.lengths[1:])) or self.lengths[0] < 1 or \
                self.lengths[-1] > MAX_CONTEXT_LEN:
            raise ValueError(f"attention_tflops lengths must be increasing whole numbers in [1, {MAX_CONTEXT_LEN}] "
                             f"(the longest context), got {_shown(self.lengths)}")
        for name in ("peak_tflops", "link_gbps", "hbm_gbps", "inter_node_gbps"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {getattr(self, name)}")
        for name, curve in (("forward", self.forward_tflops), ("backward", self.backward_tflops)):
            # NaN compares false to everything: ask for what is wanted, never test for what is not
            if not all(0 < value < math.inf for value in curve):
                raise ValueError(f"attention_tflops {name} values must be positive finite TFLOP/s, got "
                                 f"{_shown(curve)}")
        if self.query_tile < 1:
            raise ValueError(f"query_tile must be at least 1, got {self.query_tile}")
        if not all(0 <= value < math.inf for value in (self.kernel_overhead_us, self.collective_latency_us,
                                                        self.sequence_overhead_us)):
            raise ValueError("kernel_overhead_us, sequence_overhead_us and collective_latency_us must not be "
                             "negative")

    def attention_tflops(self, length, backward: bool = False) -> np.ndarray:
        """Achieved TFLOP/s of a kernel over sequences of ``length`` tokens (array in, float64 array out).

        Log-log interpolation between the curve's points; below the first point the first segment's power
        law continues, above the last point the last value holds; never above ``peak_tflops``.
        """
        knots, values = self.log_curve(backward)
        length = np.asarray(length, dtype=np.float64)
        flat = np.ascontiguousarray(length.ravel())
        return curve_tflops(flat, knots, values, float(self.peak_tflops)).reshape(length.shape)

    def log_curve(self, backward: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(log lengths, log TFLOP/s)`` of the forward or backward curve, as the objective reads them."""
        curve = self.backward_tflops if backward else self.forward_tflops
        return np.log(np.asarray(self.lengths, dtype=np.float64)), np.log(np.asarray(curve, dtype=np.float64))

    def padded_rows(self, rows) -> np.ndarray:
        """Query rows a kernel computes for ``rows`` queries: rounded up to whole tiles (float64 array)."""
        rows = np.maximum(np.asarray(rows, dtype=np.float64), 1.0)
        return np.ceil(rows / self.query_tile) * self.query_tile

    def to_json(self) -> dict:
        """The profile as its JSON file holds it."""
        def entry(name, value):
            return {"value": value, "source": self.sources.get(name, "")}

        curve = {"lengths": list(self.lengths), "forward": list(self.forward_tflops),
                 "backward": list(self.backward_tflops), "source": self.sources.get("attention_tflops", "")}
        if "attention_tflops.extrapolation" in self.sources:
            curve["extrapolation"] = self.sources["attention_tflops.extrapolation"]
        return {"format": PROFILE_FORMAT, "format_version": 1, "name": self.name,
                "calibrated": self.calibrated,
                "peak_tflops": entry("peak_tflops", self.peak_tflops), "attention_tflops": curve,
                **{name: entry(name, float(getattr(self, name))) for name in (*SCALARS, *OPTIONAL)
                   if name != "peak_tflops"}}


def _shown(values) -> str:
    """A list of numbers as a short phrase (the first six)."""
    shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in list(values)[:6])
    return f"[{shown}{', ...' if len(values) > 6 else ''}]"


def _curve_numbers(curve: dict, key: str, label: str) -> list[float]:
    """The ``key`` list of an attention curve as floats; one sentence unless every entry is a finite number."""
    values = curve[key]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise FlashcpError(f"hardware profile {label} is not valid: attention_tflops {key} must be finite "
                           f"numbers, got {_shown(values)}")
    return [float(v) for v in values]


def _number(obj: dict, name: str, label: str) -> float:
    entry = obj.get(name)
    value = entry.get("value") if isinstance(entry, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FlashcpError(f"hardware profile {label} needs '{name}' as "
                           '{"value": number, "source": text}')
    return float(value)


def profile_from_json(obj, label: str) -> HardwareProfile:
    """The profile a parsed profile file ``obj`` describes (``label`` names it in errors: one sentence)."""
    if not isinstance(obj, dict) or obj.get("format") != PROFILE_FORMAT:
        raise FlashcpError(f"{label} is not a flashcp hardware profile (its 'format' is not "
                           f"'{PROFILE_FORMAT}')")
    curve = obj.get("attention_tflops")
    if not isinstance(curve, dict) or not all(isinstance(curve.get(k), list) and curve[k]
                                              for k in ("lengths", "forward", "backward")):
        raise FlashcpError(f"hardware profile {label} needs 'attention_tflops' with non-empty 'lengths', "
                           "'forward' and 'backward' lists")
    sources = {name: str(obj[name].get("source", "")) for name in (*SCALARS, *OPTIONAL)
               if isinstance(obj.get(name), dict)}
    sources["attention_tflops"] = str(curve.get("source", ""))
    if "extrapolation" in curve:
        sources["attention_tflops.extrapolation"] = str(curve["extrapolation"])
    lengths, forward, backward = (_curve_numbers(curve, key, label) for key in ("lengths", "forward", "backward"))
    if any(v != int(v) for v in lengths):
        raise FlashcpError(f"hardware profile {label} is not valid: attention_tflops lengths must be whole "
                           f"numbers, got {_shown(lengths)}")
    values = {name: _number(obj, name, label) for name in SCALARS}
    values.update({name: _number(obj, name, label) if name in obj else default
                   for name, default in OPTIONAL.items()})
    if values["gpus_per_node"] != int(values["gpus_per_node"]) or values["gpus_per_node"] < 0:
        raise FlashcpError(f"hardware profile {label}: gpus_per_node must be a whole number, 0 or more")
    try:
        return HardwareProfile(
            name=str(obj.get("name", label)), calibrated=bool(obj.get("calibrated", False)),
            peak_tflops=values["peak_tflops"], lengths=tuple(int(v) for v in lengths),
            forward_tflops=tuple(forward), backward_tflops=tuple(backward), query_tile=int(values["query_tile"]),
            link_gbps=values["link_gbps"], hbm_gbps=values["hbm_gbps"],
            kernel_overhead_us=values["kernel_overhead_us"],
            collective_latency_us=values["collective_latency_us"],
            sequence_overhead_us=values["sequence_overhead_us"], causal_skip=bool(values["causal_skip"]),
            inter_node_gbps=values["inter_node_gbps"], gpus_per_node=int(values["gpus_per_node"]), sources=sources)
    except (TypeError, ValueError) as e:
        raise FlashcpError(f"hardware profile {label} is not valid: {e}") from None


def load_profile(path: str | Path | None = None) -> HardwareProfile:
    """Read a profile file; ``None`` reads the default H100 NVLink profile. Bad files get one sentence."""
    if path is None:
        resource = resources.files("flashcp.costmodel") / "profiles" / DEFAULT_PROFILE
        text, label = resource.read_text(), f"flashcp/costmodel/profiles/{DEFAULT_PROFILE}"
    else:
        label = str(path)
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise FlashcpError(f"hardware profile {label} cannot be read ({type(e).__name__}: {e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FlashcpError(f"hardware profile {label} is not valid JSON ({e})") from None
    return profile_from_json(obj, label)
