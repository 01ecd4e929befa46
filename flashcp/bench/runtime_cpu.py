"""Scenario 3, runtime on CPU: real ``cp_attention`` forward + backward on gloo ranks, per strategy and comm.

``cp`` processes join a gloo group on this machine; every case (a plan and a comm mode) runs the same
sequence on all ranks with the ``reference`` kernel backend in float32: one untimed warm-up step, then
``reps`` timed steps. A step's time is the slowest rank's (ranks start together after a barrier); the
reported time is the median step. Bytes are what the collectives moved, recorded by ``CommStats``
(largest per-rank send, forward + backward). Times are reported as ratios to ``llama3``/``full`` measured
in the same run, and beside them the projection at the same size (``flashcp.costmodel.projection``, the given
hardware profile, with overlap as the runtime always does it), so the two rankings can be compared.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from datetime import timedelta

import numpy as np

from flashcp.bench.systems import PlanBook, System
from flashcp.costmodel.profile import HardwareProfile
from flashcp.costmodel.projection import project_step
from flashcp.costmodel.shape import AttentionShape

__all__ = ["cpu_cases", "runtime_cpu"]

COLLECTIVE_COMMS = ("full", "allgather", "a2a")


def cpu_cases(strategies: list[str], ring_comm: bool, improved: str | None = None) -> list[System]:
    """Every registry strategy with each collective comm, ``improved`` with ``auto``, the ring systems."""
    cases = [System(label=f"{s}/{c}", strategy=s, comm=c, overlap=True)
             for s in strategies if s != "ring" for c in COLLECTIVE_COMMS]
    if improved is not None:
        cases.append(System(label=f"{improved}/auto", strategy=improved, comm="auto", overlap=True))
    if ring_comm:
        cases += [System(label=f"{s}/ring", strategy=s, comm="ring", overlap=True)
                  for s in ("ring", "perdoc") if s in strategies]
    return cases


def _prepare(rank: int, comm: str, plan, doc_lens, shape: AttentionShape):
    """Meta and random inputs of ``rank`` for one case: ``(meta, comm, q, k, v, grad_out)``."""
    import torch

    from flashcp.runtime import CPAttnMeta

    meta = CPAttnMeta.from_plan(plan, doc_lens, rank)
    gen = torch.Generator().manual_seed(1000 + rank)
    q, grad = (torch.randn(meta.num_tokens, shape.num_heads, shape.head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(meta.num_tokens, shape.num_kv_heads, shape.head_dim, generator=gen) for _ in range(2))
    return meta, comm, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def _worker(rank: int, world_size: int, port: int, cases, shape: AttentionShape, reps: int, out_path: str):
    import torch
    import torch.distributed as dist

    from flashcp.runtime import CommStats, cp_attention
    from flashcp.train.launch import init_local_gloo

    init_local_gloo(rank, world_size, port, timeout=timedelta(seconds=300))
    try:
        link = _gloo_link(world_size)
        runs = [_prepare(rank, comm, plan, doc_lens, shape) for comm, plan, doc_lens in cases]
        times: list[list[float]] = [[] for _ in runs]
        sent = torch.zeros(len(runs), dtype=torch.float64)
        # rounds over all cases, so that a slow spell of the machine hits every case alike
        for round_ in range(reps + 1):
            for i, (meta, comm, q, k, v, grad) in enumerate(runs):
                stats = CommStats()
                dist.barrier()
                started = time.perf_counter()
                out = cp_attention(q, k, v, meta, group=None, comm=comm, backend="reference", stats=stats)
                out.backward(grad)
                elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                q.grad = k.grad = v.grad = None
                if round_:
                    times[i].append(float(elapsed))
                sent[i] = stats.total("sent_bytes")
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)
        results = [link] + [{"seconds": float(np.median(t)), "sent_bytes": int(b)}
                            for t, b in zip(times, sent)]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def _gloo_link(world_size: int, rows: int = 1 << 20, reps: int = 3) -> dict:
    """Measured gloo all-gather: bytes each rank sends per second, and the time of a one-element call."""
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def timed(n):
        send = torch.ones(n)
        recv = torch.empty(n * world_size)
        times = []
        for _ in range(reps + 1):
            dist.barrier()
            started = time.perf_counter()
            all_gather(recv, send)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        return float(np.median(times[1:]))

    latency = timed(1)
    return {"link_gbps": (world_size - 1) * rows * 4 / max(timed(rows) - latency, 1e-9) / 1e9,
            "collective_latency_us": latency * 1e6}


def cpu_profile(base: HardwareProfile, shape: AttentionShape, context_len: int, cp: int, link: dict,
                reps: int = 2) -> HardwareProfile:
    """``base`` calibrated on this CPU (``reference`` kernels, float32, ``shape``) with the gloo link."""
    import torch

    from flashcp.bench.calibrate import calibrate_profile

    per_rank = max(16, context_len // cp)
    lengths = sorted({n for n in (4, 16, 64, 256, 1024) if n < per_rank} | {per_rank})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        profile = calibrate_profile(base, torch.device("cpu"), dtype=torch.float32, shape=shape,
                                    lengths=lengths, total_tokens=per_rank, backend="reference", reps=reps)
    finally:
        torch.set_num_threads(threads)
    sources = dict(profile.sources)
    sources["link_gbps"] = f"measured: gloo all-gather of {4 << 20} bytes per rank on {cp} local ranks"
    sources["collective_latency_us"] = f"measured: gloo all-gather of one float on {cp} local ranks"
    return replace(profile, link_gbps=link["link_gbps"], collective_latency_us=link["collective_latency_us"],
                   sources=sources)


def runtime_cpu(book: PlanBook, source, systems: list[System], cp: int, context_len: int, shape: AttentionShape,
                num_seqs: int, reps: int, profile: HardwareProfile,
                ranked: list[System] | None = None) -> dict:
    """Measured CPU step time and bytes per case, ratios to llama3/full, and the projection beside them.

    ``ranked`` (the bench's systems) picks the cases whose measured and projected orders are compared.
    """
    import torch.multiprocessing as mp

    from flashcp.train.launch import free_port

    sequences = book.sequences(source, num_seqs, context_len)
    cases = []
    for system in systems:
        for plan, doc_lens in zip(book.plans(source, num_seqs, context_len, system.strategy, cp), sequences):
            cases.append((system.comm, plan, doc_lens))
    fd, out_path = tempfile.mkstemp(prefix="flashcp-bench-", suffix=".json")
    os.close(fd)
    started = time.perf_counter()
    try:
        mp.spawn(_worker, args=(cp, free_port(), cases, shape, reps, out_path), nprocs=cp, join=True)
        with open(out_path) as f:
            measured = json.load(f)
    finally:
        os.unlink(out_path)
    link, measured = measured[0], measured[1:]
    model = cpu_profile(profile, shape, context_len, cp, link)
    rows: list[dict] = []
    for i, system in enumerate(systems):
        mine = measured[i * len(sequences):(i + 1) * len(sequences)]
        mine_cases = cases[i * len(sequences):(i + 1) * len(sequences)]
        rows.append({"case": system.label, "key": system.key, "strategy": system.strategy,
                     "comm": system.comm,
                     "step_ms": 1e3 * float(np.mean([m["seconds"] for m in mine])),
                     "sent_mb": float(np.mean([m["sent_bytes"] for m in mine])) / 1e6,
                     "projected_ms": _projected_ms(mine_cases, shape, model),
                     "gpu_projected_ms": _projected_ms(mine_cases, shape, profile)})
    base = next((r for r in rows if r["key"] == "llama3/full"), rows[0])
    for row in rows:
        row["ratio"] = row["step_ms"] / base["step_ms"]
        row["projected_ratio"] = row["projected_ms"] / base["projected_ms"]
    # one plan under the three collective comm modes: at this size they differ little in work, so their
    # spread shows how far apart two measurements of about the same step can be on this machine
    spreads: dict[str, list[float]] = {"step_ms": [], "projected_ms": []}
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        same = [r for r in rows if r["strategy"] == strategy and r["comm"] in COLLECTIVE_COMMS]
        if len(same) == len(COLLECTIVE_COMMS):
            for key, values in spreads.items():
                values.append(max(r[key] for r in same) / min(r[key] for r in same) - 1.0)
    by_case = {r["key"]: r for r in rows}
    named = [(s.label, by_case[s.key]) for s in ranked or [] if s.key in by_case]
    # the ring systems run other kernels (block-wise with log-sum-exp merges) than the collective ones,
    # so the orders are also compared among the systems that share the kernel code
    collective = [(label, r) for label, r in named if r["comm"] != "ring"]
    # strategies: the mean over their collective comm modes, which averages out some of the machine's noise
    strategies = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = [r for r in rows if r["strategy"] == strategy and r["comm"] != "ring"]
        if mine:
            strategies.append((strategy, {key: float(np.mean([r[key] for r in mine]))
                                          for key in ("step_ms", "projected_ms")}))
    return {"cpu_profile": model.to_json(), "source": source.label, "context_len": context_len, "cp": cp,
            "num_heads": shape.num_heads, "ring": _ring_ratios(rows),
            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "dtype": "float32",
            "backend": "reference", "num_seqs": len(sequences), "reps": reps, "baseline": base["case"],
            "rows": rows, "strategy_ranking": _ranking(strategies), "system_ranking": _ranking(named),
            "collective_ranking": _ranking(collective),
            "projected_share": float(np.mean([r["projected_ms"] / r["step_ms"] for r in rows
                                               if r["comm"] != "ring"] or [np.nan])),
            "comm_mode_spread": {k: float(np.median(v)) for k, v in spreads.items()} if spreads["step_ms"]
            else None,
            "spearman_all_cases": _spearman([r["step_ms"] for r in rows], [r["projected_ms"] for r in rows]),
            "wall_seconds": time.perf_counter() - started}


def _ring_ratios(rows: list[dict]) -> dict:
    """Measured step time with ring comm over ``full`` on the same layout, and each ring system's over others.

    The others: the paper's systems (``ring_cost.SYSTEMS``) present among the cases.
    """
    from flashcp.bench.ring_cost import SYSTEMS

    ms = {(r["strategy"], r["comm"]): r["step_ms"] for r in rows}
    same_layout = {s: ms[(s, "ring")] / ms[(s, "full")] for s, c in ms if c == "ring" and (s, "full") in ms}
    over = {}
    for baseline in (("ring", "ring"), ("perdoc", "ring")):
        if baseline in ms:
            over[SYSTEMS[baseline]] = {SYSTEMS[k]: ms[baseline] / ms[k] for k in SYSTEMS
                                       if k in ms and k != baseline}
    return {"ring_over_full": same_layout, "system_over": over}


def _projected_ms(cases, shape: AttentionShape, profile: HardwareProfile) -> float:
    """Mean projected step of ``(comm, plan, doc_lens)`` cases, with overlap as the runtime does it."""
    steps = [project_step(plan, shape, profile, comm, True).total for comm, plan, _ in cases]
    return 1e3 * float(np.mean(steps))


def _ranking(named: list[tuple[str, dict]]) -> dict:
    """Measured and projected orders (fastest first) of ``(label, row)`` pairs, and whether they agree."""
    measured = [label for label, _ in sorted(named, key=lambda x: x[1]["step_ms"])]
    projected = [label for label, _ in sorted(named, key=lambda x: x[1]["projected_ms"])]
    return {"systems": [label for label, _ in named], "measured_order": measured,
            "projected_order": projected, "same_order": measured == projected,
            "spearman": _spearman([r["step_ms"] for _, r in named], [r["projected_ms"] for _, r in named])}


def _spearman(a, b) -> float:
    """Rank correlation of two equally long lists (1 = same order)."""
    if len(a) < 2:
        return 1.0
    ra, rb = (np.argsort(np.argsort(x)).astype(np.float64) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])
