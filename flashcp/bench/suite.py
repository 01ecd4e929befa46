"""The bench run: its configuration (full and ``--quick`` sizes) and the scenarios it runs, in one dict.

``run_bench(config)`` runs the selected scenarios on shared sequences and plans (``PlanBook``) and returns
every number in a JSON-ready dict; ``flashcp.bench.report`` prints it and ``flashcp.bench.plots`` draws it.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flashcp import __version__
from flashcp.bench.dp import dp_scenario
from flashcp.bench.latency import latency_scenario
from flashcp.bench.quality import parse_strategy, plan_quality
from flashcp.bench.ring_cost import ring_cost
from flashcp.bench.runtime_cpu import cpu_cases, runtime_cpu
from flashcp.bench.sequences import SequenceSource, open_source
from flashcp.bench.speed import end_to_end, planner_speed
from flashcp.bench.systems import PlanBook, System, available_strategies, default_systems, improved_strategy
from flashcp.costmodel.models import DEFAULT_MODEL, resolve_model
from flashcp.costmodel.profile import HardwareProfile
from flashcp.costmodel.shape import AttentionShape
from flashcp.outputs import json_report
from flashcp.planner.batch import needs_compile
from flashcp.planner.registry import get_strategy

__all__ = ["BENCH_REPORT", "EXTRA_SCENARIOS", "SCENARIOS", "BenchConfig", "bench_config", "run_bench"]

BENCH_REPORT = json_report("flashcp-bench", "a flashcp bench report",
                           legacy=lambda v: "flashcp_version" in v and "config" in v and "seconds" in v)
"""``flashcp bench --json FILE``: the ``run_bench`` dict (written before it carried ``format``: by its keys)."""

SCENARIOS = ("quality", "speed", "runtime", "latency")
"""The scenarios a plain run runs, in order: plan quality, planner speed, CPU runtime, projected latency."""
EXTRA_SCENARIOS = ("ring-cost", "dp")
"""Scenarios run only when ``--scenario`` names them: the ring baselines by the cost model, the DP step
efficiency."""
DEFAULT_DISTS = ("wlb", "prolong", "pile")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    """What one ``flashcp bench`` run does."""

    sources: tuple[str, ...]
    """Distributions (``wlb``, ``prolong``, ``pile``, a JSON of lengths) and/or dataset folders."""
    scenarios: tuple[str, ...] = SCENARIOS
    """Which of SCENARIOS to run."""
    cps: tuple[int, ...] = (4, 8)
    """CP sizes for plan quality and latency."""
    strategies: tuple[str, ...] | None = None
    """Strategy specs for plan quality (``flashcp+@1.05``, ``flashcp2:effort=4``); None: every strategy."""
    price_tokens: bool = False
    """Plan quality's projected step time also prices the per-token layers (plans made with token slack)."""
    model: str = DEFAULT_MODEL
    """The model plan quality prices (one layer of it) and ``flashcp2`` plans for, and the dp scenario prices
    whole sequences of: a built-in name or a Hugging Face config path (``resolve_model``)."""
    gpus_per_node: int = 0
    """Plan quality prices every plan with this many CP ranks per node and reports inter-node receive (0: one
    node)."""
    time_sequences: bool = False
    """Plan quality also times every sequence alone (CPU ms p50 / p99 / max)."""
    heads: tuple[int, ...] = (16, 32)
    """Attention heads for the latency projection (head dim 128, bf16)."""
    context_len: int = 131072
    """Context length of distribution sources (a dataset keeps its own)."""
    num_seqs: int = 32
    """Sequences per source for plan quality and latency."""
    sweep_seqs: int = 16
    """Sequences per context length in the Figure 7 sweep."""
    speed_seqs: int = 64
    """Sequences timed per strategy for planner speed."""
    e2e_seqs: int = 0
    """Planner speed end to end: sequences of a lengths-only dataset to synthesise, plan and verify (0: none)."""
    e2e_strategies: tuple[str, ...] = ("flashcp", "flashcp+")
    """Strategies planned end to end."""
    workers: tuple[int, ...] = (1, 2)
    """Worker counts of the end-to-end ``plan``."""
    runtime_context_len: int = 8192
    """Context length of the CPU runtime scenario."""
    runtime_cp: int = field(default_factory=lambda: max(2, min(4, os.cpu_count() or 2)))
    """Gloo ranks of the CPU runtime scenario: one per core, 2 to 4."""
    runtime_seqs: int = 2
    """Sequences per case in the CPU runtime scenario."""
    runtime_reps: int = 3
    """Timed steps per case (after one warm-up)."""
    runtime_systems_only: bool = False
    """Time only the bench's systems on CPU, not every strategy with every comm mode."""
    runtime_cases: tuple[str, ...] | None = None
    """``strategy/comm`` cases of the CPU runtime scenario (``ring/ring``, ``perdoc/full``...); None: the
    bench's systems with ``--quick``, else every strategy with every comm mode."""
    runtime_heads: int = 4
    """Query heads of the CPU runtime scenario."""
    runtime_kv_heads: int | None = None
    """Key/value heads of the CPU runtime scenario (None: as many as query heads)."""
    runtime_head_dim: int = 32
    """Head dim of the CPU runtime scenario."""
    seed: int = 0
    """Seed of the packed sequences."""
    measured: bool = False
    """Time per-rank attention on the GPU in the latency scenario (communication stays projected)."""
    measure_seqs: int = 1
    """Sequences per setting measured on the GPU."""
    measure_budget_s: float = 120.0
    """Seconds of GPU timing in the latency scenario; later settings fall back to projection."""
    device: str = "cuda"
    """Device for ``measured``."""
    dp_sizes: tuple[int, ...] = (8, 32, 128)
    """DP sizes of the DP step efficiency scenario."""
    balance_window: int = 16
    """Steps per balance window in the DP step efficiency scenario."""
    notes: list = field(default_factory=list)
    """Notes gathered while configuring (shown with the results)."""

    def __post_init__(self):
        resolve_model(self.model)  # a bad name or config: ModelError (a ValueError), before any work
        unknown = set(self.scenarios) - set(SCENARIOS + EXTRA_SCENARIOS)
        if unknown:
            raise ValueError(f"unknown scenario {sorted(unknown)[0]!r}: choose from "
                             f"{', '.join(SCENARIOS + EXTRA_SCENARIOS)}")
        if not self.sources:
            raise ValueError("no sources: give DATA or --dist")
        if min(self.cps) < 1 or min(self.heads) < 1 or self.num_seqs < 1 or self.runtime_cp < 1:
            raise ValueError("cp sizes, head counts and sequence counts must be positive")
        if min(self.dp_sizes) < 1 or self.balance_window < 0:
            raise ValueError(f"--dp sizes must be positive and --balance-window at least 0, got dp "
                             f"{list(self.dp_sizes)} and window {self.balance_window}")
        if "runtime" in self.scenarios and self.runtime_cp < 2:
            raise ValueError(f"--runtime-cp {self.runtime_cp}: the CPU runtime scenario times the K/V exchange "
                             "between gloo ranks, so it needs at least 2; give --runtime-cp 2 or more, or leave "
                             "the runtime scenario out with --scenario")
        from flashcp.costmodel.limits import check_context_len
        from flashcp.planner.params import check_shape
        from flashcp.planner.registry import get_strategy

        if "runtime" in self.scenarios:
            try:
                check_shape(self.runtime_context_len, self.runtime_cp)
            except ValueError as e:
                raise ValueError(f"--runtime-cp {self.runtime_cp} with --runtime-context-len "
                                 f"{self.runtime_context_len}: {e}") from None
        from flashcp.runtime.meta import COMM_MODES

        check_context_len(self.context_len, "--context-len")
        check_context_len(self.runtime_context_len, "--runtime-context-len")
        for case in self.runtime_cases or ():
            strategy, sep, comm = case.partition("/")
            if not sep or comm not in (*COMM_MODES, "auto"):
                raise ValueError(f"runtime case '{case}': expected STRATEGY/COMM with COMM one of "
                                 f"{', '.join(COMM_MODES)}, auto")
            if strategy not in available_strategies():
                raise ValueError(f"runtime case '{case}': unknown strategy '{strategy}'")
        kv_heads = self.runtime_kv_heads or self.runtime_heads
        if self.runtime_heads % kv_heads:
            raise ValueError(f"runtime heads ({self.runtime_heads}) must be a multiple of runtime key/value "
                             f"heads ({kv_heads})")
        if self.e2e_seqs and Path(self.sources[0]).is_dir():
            raise ValueError("the end-to-end planner speed synthesises a distribution: give --dist, not DATA")
        for name in self.e2e_strategies if self.e2e_seqs else ():
            get_strategy(name)
        for spec in self.strategies or ():
            parse_strategy(spec)  # a bad spec fails here, before any scenario runs


def bench_config(*, quick: bool, data: str | None = None, dists: tuple[str, ...] | None = None,
                 **overrides) -> BenchConfig:
    """The full or ``--quick`` configuration; DATA alone replaces the default distributions."""
    sources = ((data,) if data else ()) + (dists if dists is not None else (() if data else DEFAULT_DISTS))
    sizes: dict = dict(num_seqs=4, sweep_seqs=2, speed_seqs=8, runtime_context_len=4096,
                       runtime_seqs=1, runtime_reps=1, runtime_systems_only=True) if quick else {}
    sizes.update({k: v for k, v in overrides.items() if v is not None})
    return BenchConfig(sources=sources, **sizes)


def _runtime_source(sources: list[SequenceSource]) -> SequenceSource:
    """The CPU runtime runs on DATA when given (re-packed at its size), else ``pile`` (many documents)."""
    return next((s for s in sources if s.is_dataset), next((s for s in sources if s.label == "pile"),
                                                         sources[0]))


def run_bench(config: BenchConfig, profile: HardwareProfile, log=print) -> dict:
    """Run ``config.scenarios`` and return every number (JSON-ready). ``log`` gets progress lines."""
    started = time.perf_counter()
    sources = [open_source(spec) for spec in config.sources]
    book = PlanBook(config.seed)
    strategies = available_strategies()
    systems, notes = default_systems()
    results: dict = {
        "format": "flashcp-bench", "flashcp_version": __version__, "torch": torch.__version__,
        "machine": platform.machine(),
        "config": {k: v for k, v in asdict(config).items() if k != "notes"},
        "profile": profile.to_json(), "strategies": strategies, "improved_strategy": improved_strategy(),
        "systems": [{"label": s.label, "strategy": s.strategy, "comm": s.comm, "overlap": s.overlap}
                    for s in systems], "notes": list(config.notes) + notes, "seconds": {}}
    if not strategies:
        results["notes"].append("no planner strategies are available: nothing to bench")
        return results

    def timed(name, fn, doing=""):
        log(f"bench: {name}{': ' + doing if doing else ''}...")
        t0 = time.perf_counter()
        results[name] = fn()
        results["seconds"][name] = time.perf_counter() - t0

    compiling = [name for name in strategies if get_strategy(name).kernel is not None
                 and needs_compile(get_strategy(name))]
    if compiling and {"quality", "speed", "latency", "ring-cost"} & set(config.scenarios):
        log(f"bench: compiling the planner kernels of {', '.join(compiling)} first (once: later runs load them "
            "from the cache; tens of seconds)")
    labels = ", ".join(source.label for source in sources)
    cps = ", ".join(map(str, config.cps))
    if "quality" in config.scenarios:
        specs = list(config.strategies or strategies)
        timed("quality", lambda: plan_quality(book, sources, specs, list(config.cps), config.context_len,
                                              config.num_seqs, config.price_tokens, config.gpus_per_node,
                                              config.time_sequences, resolve_model(config.model)),
              f"planning {config.num_seqs} sequence(s) of {config.context_len:,} tokens from each of {labels} "
              f"with {len(specs)} strategies at cp {cps}")
    if "ring-cost" in config.scenarios:
        timed("ring-cost", lambda: ring_cost(book, sources, strategies, list(config.cps), config.context_len,
                                             config.num_seqs, config.seed))
    if "dp" in config.scenarios:
        timed("dp", lambda: dp_scenario(sources, list(config.dp_sizes), config.balance_window, config.num_seqs,
                                        config.context_len, config.seed, resolve_model(config.model)),
              f"pricing {config.num_seqs} sequence(s) from each of {labels} and grouping them into DP steps")
    if "speed" in config.scenarios:
        timed("speed", lambda: planner_speed(book, sources[0], list(config.strategies or strategies),
                                             max(config.cps), config.context_len, config.speed_seqs),
              f"timing each planner on {config.speed_seqs} sequence(s) at cp {max(config.cps)}")
        if config.e2e_seqs:
            timed("end_to_end", lambda: end_to_end(sources[0].spec, max(config.cps), config.context_len,
                                                   config.e2e_seqs, list(config.e2e_strategies),
                                                   list(config.workers), config.seed))
    if "runtime" in config.scenarios:
        ring = any(s.comm == "ring" for s in systems)
        # --quick times the bench's systems only; the full run every strategy with every comm mode
        if config.runtime_cases:
            cases = [System(label=key, strategy=key.partition("/")[0], comm=key.partition("/")[2], overlap=True)
                     for key in config.runtime_cases]
        elif config.runtime_systems_only:
            cases = systems
        else:
            cases = cpu_cases(strategies, ring, improved_strategy())
        shape = AttentionShape(num_heads=config.runtime_heads,
                           num_kv_heads=config.runtime_kv_heads or config.runtime_heads,
                           head_dim=config.runtime_head_dim, dtype_bytes=4)
        timed("runtime", lambda: runtime_cpu(book, _runtime_source(sources), cases, config.runtime_cp,
                                             config.runtime_context_len, shape, config.runtime_seqs,
                                             config.runtime_reps, profile, systems),
              f"cp_attention forward and backward of {len(cases)} case(s) on {config.runtime_cp} gloo ranks "
              f"(C={config.runtime_context_len:,}, {config.runtime_seqs} sequence(s), one warm-up and "
              f"{config.runtime_reps} timed step(s) each; starting the ranks takes seconds)")
    if "latency" in config.scenarios:
        measure = None
        if config.measured:
            measure = _gpu_measure(config.device)
        timed("latency", lambda: latency_scenario(
            book, sources, systems, list(config.cps), list(config.heads), config.context_len, config.num_seqs,
            profile, sweep_seqs=config.sweep_seqs, measure=measure, measure_seqs=config.measure_seqs,
            measure_budget_s=config.measure_budget_s),
              f"{'measuring' if config.measured else 'projecting'} the step latency of {len(systems)} systems "
              f"at cp {cps}")
    results["seconds"]["total"] = time.perf_counter() - started
    return results


def _gpu_measure(device_name: str):
    """``measure(plan, doc_lens, shape, profile, comm) -> RankWork`` timing every rank on one GPU."""
    from flashcp.bench.measure import measured_work
    from flashcp.errors import FlashcpError

    device = torch.device(device_name)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise FlashcpError(f"--measured needs a CUDA device, and '{device_name}' is not an available one")

    def measure(plan, doc_lens, shape, profile, comm):
        return measured_work(plan, doc_lens, shape, profile, comm, device)

    return measure
