"""Scenario 4, projected step latency in the paper's setting (Figures 5, 6 and 7), and the targets.

For every source, CP size and head count, each system's plans are projected with
``flashcp.costmodel.projection.project_step`` (one attention layer, forward + backward, bf16, D = 128,
multi-head attention as in the paper's Eq. 4-5) and averaged over the sequences:

- Figure 5: latency normalised to Llama3 CP (``speedup = mean Llama3 latency / mean system latency``);
- Figure 6: the mean split into attention forward, attention backward, exposed communication and other;
- Figure 7: speedup against context length (64K-128K) on one source at CP 8.

With ``measure`` (a GPU, ``flashcp.bench.measure``), per-rank attention is timed on the device for up to
``measure_seqs`` sequences per setting and communication stays projected; those rows say ``measured``.
Every other number here is *projected*.
"""

from __future__ import annotations

import time

import numpy as np

from flashcp.bench.systems import PlanBook, System
from flashcp.costmodel.profile import HardwareProfile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.shape import AttentionShape

__all__ = ["PAPER_AVERAGES", "SWEEP_CONTEXT_LENS", "latency_scenario", "project_setting"]

PAPER_AVERAGES = {"Llama3 CP": 1.38, "Per-Doc CP": 1.63}
"""FlashCP's average training+inference speedups in the paper (section 4.2), over each baseline."""
SWEEP_CONTEXT_LENS = (65536, 81920, 98304, 114688, 131072)
"""Figure 7's context lengths (64K to 128K)."""
BREAKDOWN = ("attn_fwd", "attn_bwd", "comm", "other")


def project_setting(book: PlanBook, source, systems: list[System], cp: int, shape: AttentionShape,
                    context_len: int, num_seqs: int, profile: HardwareProfile, measure=None,
                    measure_seqs: int = 0, deadline: float | None = None) -> dict:
    """One setting: per system, mean latency (ms), its breakdown, speedup over the first system, extras."""
    results: dict[str, dict] = {}
    # a setting is measured whole or not at all, so that its speedups never mix measured and projected
    # (ring systems, which cannot be timed per rank, are projected on the same measured sequences)
    measure_here = measure is not None and (deadline is None or time.monotonic() < deadline)
    count = min(measure_seqs, num_seqs) if measure_here else num_seqs
    for system in systems:
        plans = book.plans(source, num_seqs, context_len, system.strategy, cp)[:count]
        sequences = book.sequences(source, num_seqs, context_len)[:count]
        steps, measured = [], 0
        for plan, doc_lens in zip(plans, sequences):
            work = None
            if measure_here and system.comm != "ring":
                work = measure(plan, doc_lens, shape, profile, system.comm)
                measured += 1
            steps.append(project_step(plan, shape, profile, system.comm, system.overlap, work))
        mean = {k: float(np.mean([getattr(s, k) for s in steps])) * 1e3 for k in ("total", *BREAKDOWN)}
        modes = sorted({s.comm_mode for s in steps})
        results[system.label] = {
            "strategy": system.strategy, "comm": system.comm, "overlap": system.overlap, "ours": system.ours,
            "latency_ms": mean["total"], "breakdown_ms": {k: mean[k] for k in BREAKDOWN},
            "comm_modes": modes, "comm_mb": float(np.mean([s.comm_bytes for s in steps])) / 1e6,
            "kernels": float(np.mean([s.kernels for s in steps])), "num_seqs": len(steps),
            "kind": "measured" if measured else "projected"}
    base = float(results[systems[0].label]["latency_ms"])
    for row in results.values():
        row["speedup"] = base / float(row["latency_ms"])
    return results


def _check_targets(settings: list[dict]) -> list[dict]:
    """Target 1: FlashCP beats Llama3 CP and Per-Doc CP everywhere; target 2: ours beats FlashCP."""
    targets = []
    for baseline in ("Llama3 CP", "Per-Doc CP"):
        ratios = [(s, s["systems"]["FlashCP"]["latency_ms"], s["systems"][baseline]["latency_ms"])
                  for s in settings if "FlashCP" in s["systems"] and baseline in s["systems"]]
        if ratios:
            targets.append(_target(f"FlashCP faster than {baseline} in every setting", ratios))
    ours = [s for s in settings if any(r["ours"] for r in s["systems"].values())]
    pairs = []
    for s in ours:
        label = next(k for k, r in s["systems"].items() if r["ours"])
        if "FlashCP" in s["systems"]:
            pairs.append((s, s["systems"][label]["latency_ms"], s["systems"]["FlashCP"]["latency_ms"]))
    if pairs:
        targets.append(_target("ours (improved strategy, auto comm, overlap) faster than FlashCP in every "
                               "setting", pairs))
    return targets


def _target(name: str, triples) -> dict:
    speedups = [other / mine for _, mine, other in triples]
    misses = [f"{s['source']} cp{s['cp']} H{s['num_heads']}: {other / mine:.3f}x"
              for s, mine, other in triples if mine >= other]
    return {"target": name, "met": not misses, "min_speedup": min(speedups),
            "mean_speedup": float(np.mean(speedups)), "misses": misses}


def latency_scenario(book: PlanBook, sources, systems: list[System], cps: list[int], heads: list[int],
                     context_len: int, num_seqs: int, profile: HardwareProfile, head_dim: int = 128,
                     sweep_seqs: int | None = None, measure=None, measure_seqs: int = 1,
                     measure_budget_s: float | None = None) -> dict:
    """Figures 5-7 for ``systems`` (the first one is the baseline, Llama3 CP) plus the targets."""
    deadline = None if measure_budget_s is None else time.monotonic() + measure_budget_s
    settings = []
    for source in sources:
        c = source.dataset_context_len or context_len
        for cp in cps:
            for num_heads in heads:
                shape = AttentionShape(num_heads=num_heads, num_kv_heads=num_heads, head_dim=head_dim)
                settings.append({"source": source.label, "context_len": c, "cp": cp, "num_heads": num_heads,
                                 "head_dim": head_dim, "systems": project_setting(
                                     book, source, systems, cp, shape, c, num_seqs, profile, measure,
                                     measure_seqs, deadline)})
    averages = {}
    for baseline, paper in PAPER_AVERAGES.items():
        speedups = [s["systems"][baseline]["latency_ms"] / s["systems"]["FlashCP"]["latency_ms"]
                    for s in settings if baseline in s["systems"] and "FlashCP" in s["systems"]]
        if speedups:
            averages[baseline] = {"paper": paper, "ours": float(np.mean(speedups)), "settings": len(speedups)}
    sweep = []
    sweep_source = next((s for s in sources if not s.is_dataset), None)
    if sweep_source is not None and max(cps) > 1:
        cp, shape = max(cps), AttentionShape(num_heads=max(heads), num_kv_heads=max(heads), head_dim=head_dim)
        for c in SWEEP_CONTEXT_LENS:
            result = project_setting(book, sweep_source, systems, cp, shape, c, sweep_seqs or num_seqs,
                                     profile)
            sweep.append({"context_len": c, "speedup": {k: r["speedup"] for k, r in result.items()},
                          "latency_ms": {k: r["latency_ms"] for k, r in result.items()}})
    return {"profile": profile.name, "calibrated": profile.calibrated, "measured": measure is not None,
            "settings": settings, "paper_averages": averages, "targets": _check_targets(settings),
            "sweep": {"source": sweep_source.label if sweep_source else None, "cp": max(cps),
                      "num_heads": max(heads), "points": sweep}}
