"""Terminal report of a bench run: one rich table per scenario, the paper comparison and the targets.

Every latency number from the projection is labelled PROJECTED (or MEASURED where ``--measured`` timed the
per-rank attention on a GPU); CPU runtime numbers are measured.
"""

from __future__ import annotations

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["paper_comparison", "print_report", "print_speed"]

REPORT_WIDTH = 160
"""Columns of the tables when the output is not a terminal."""
RANKINGS = (("strategy_ranking", "strategies (mean over their collective comm modes)"),
            ("system_ranking", "systems"), ("collective_ranking", "collective systems"))
"""The CPU runtime orders compared with the projection's."""
CPU_RUNTIME_SCOPE = (
    "What this CPU measurement shows: every strategy and comm mode runs forward and backward on real gloo ranks, "
    "with the bytes each rank sends (the same on GPUs), and whether the CPU-calibrated model orders the cases as "
    "measured.",
    "What it cannot show: which strategy is fastest on GPUs. The CPU reference kernel computes each shard's whole "
    "query x key rectangle (GPU kernels skip masked tiles), which favours plans that cut documents into many small "
    "shards over plans that keep them whole, as flashcp2 does; the ranks share this machine's cores and gloo "
    "copies through memory. Where flashcp2 measures slower here, that is expected, not a failure: GPU speed is "
    "the PROJECTED latency (or --measured on a GPU).")
"""What the runtime scenario's numbers can and cannot show, printed under its table."""


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    return table


def _show(console: Console, table: Table) -> None:
    # off a terminal (files, CI logs) rich would squeeze tables into 80 columns
    width = console.width
    if not console.is_terminal:
        console.width = max(width, REPORT_WIDTH)
    try:
        console.print(table)
    finally:
        console.width = width


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _quality(console: Console, quality: dict) -> None:
    rows = quality["rows"]
    priced = "per-token layers priced" if quality.get("price_tokens") else "attention and exchange"
    model = quality.get("model")  # reports written before the bench named its model priced H=32, H_kv=32
    shape = f"{model['name']} (H={model['num_heads']}, H_kv={model['num_kv_heads']}, D={model['head_dim']})" \
        if model else "H=32 H_kv=32 D=128 (no model)"
    kinds = {run["kind"] for run in model.get("layers", [])} if model else set()
    layer = "one layer" if kinds <= {"full"} else "the mean layer (each layer kind priced on its own)"
    table = _table(f"Plan quality ({rows[0]['num_seqs']} sequences per source; exact-need received: the busiest "
                   f"rank's receive as a share of a full K/V all-gather's; step ms: projected, {layer} of "
                   f"{shape}, H100, {priced})", "source", "C", "cp", "strategy", "imbal mean", "p50", "max",
                   "all-gather saving", "exact-need received", "shards/rank", "mean shard len", "step ms",
                   "plan s")
    nodes = any("inter_pct" in r for r in rows)
    timed = any("plan_ms_p50" in r for r in rows)
    if nodes:
        table.add_column("intra-node recv", justify="right")
        table.add_column("inter-node recv", justify="right")
    if timed:
        table.add_column("plan ms p50/p99/max (CPU)", justify="right")
    table.columns[3].min_width = max(len(r["strategy"]) for r in rows)  # specs in full, never cut
    last = None
    for r in rows:
        if last is not None and (r["source"], r["cp"]) != last:
            table.add_section()
        last = (r["source"], r["cp"])
        extra = []
        if nodes:
            extra += [f"{r['intra_pct']:.1f}%", f"{r['inter_pct']:.1f}%"] if "inter_pct" in r else ["-", "-"]
        if timed:
            extra.append(f"{r['plan_ms_p50']:.2f}/{r['plan_ms_p99']:.2f}/{r['plan_ms_max']:.2f}")
        table.add_row(r["source"], str(r["context_len"]), str(r["cp"]), r["strategy"],
                      f"{r['imbalance_mean']:.4f}", f"{r['imbalance_p50']:.4f}", f"{r['imbalance_max']:.4f}",
                      _pct(r["ag_saving_mean"]), f"{r['received_pct']:.1f}%", f"{r['shards_per_rank']:.1f}",
                      f"{r['shard_len_mean']:.0f}", f"{r['step_ms']:.3f}", f"{r['seconds']:.2f}", *extra)
    _show(console, table)


def _ring_cost(console: Console, ring_cost: dict) -> None:
    rows = ring_cost["rows"]
    table = _table(f"Ring baselines by the cost model ({rows[0]['num_seqs']} sequences per source; largest over "
                   "ranks, mean over sequences; merged/T: query rows merged by log-sum-exp per local token; "
                   "keys/T: keys read per local token; K/V in/C: K/V tokens received per forward pass over C)",
                   "source", "C", "cp", "system", "layout+comm", "imbalance", "calls", "seqs", "merged/T",
                   "keys/T", "K/V in/C")
    last = None
    for r in rows:
        if last is not None and (r["source"], r["cp"]) != last:
            table.add_section()
        last = (r["source"], r["cp"])
        table.add_row(r["source"], str(r["context_len"]), str(r["cp"]), r["system"], f"{r['layout']}+{r['comm']}",
                      f"{r['imbalance']:.3f}", f"{r['calls']:.1f}", f"{r['sequences']:.1f}", f"{r['merged']:.2f}",
                      f"{r['gathered']:.2f}", f"{r['recv_over_c']:.3f}")
    _show(console, table)


def _dp(console: Console, dp: dict) -> None:
    rows = dp["rows"]
    shape = dp["shape"]
    priced = dp.get("model") or (f"H={shape['num_heads']}, H_kv={shape['num_kv_heads']}, D={shape['head_dim']}, "
                                 f"{shape['layers']} layers")
    table = _table(f"DP step efficiency: mean sequence cost / mean of each step's largest (1.00: no replica "
                   f"waits), priced as forward + backward FLOPs of {priced}; balanced: "
                   f"windows of {rows[0]['window'] if rows else 0} steps grouped by cost; speed-up: step time "
                   "of the stream order over the balanced one", "source", "C", "sequences", "max/min cost", "dp",
                   "steps", "stream order", "balanced", "speed-up")
    last = None
    for r in rows:
        if last is not None and r["source"] != last:
            table.add_section()
        last = r["source"]
        table.add_row(r["source"], str(r["context_len"]), str(r["num_seqs"]), f"{r['cost_ratio']:.2f}",
                      str(r["dp"]), str(r["steps"]), f"{r['stream_efficiency']:.2f}",
                      f"{r['balanced_efficiency']:.2f}", f"{r['speedup']:.2f}x")
    _show(console, table)


def _speed(console: Console, speed: dict) -> None:
    rows = speed["rows"]
    referenced = any("python_seqs_per_s" in r for r in rows)  # Python references given (scripts/plan_speed.py)
    columns = ["strategy", "Numba seq/s (per sequence)", "batch kernel seq/s", "batch + check seq/s"]
    if referenced:
        columns += ["Python seq/s", "speedup (per sequence / batch)", "same plans"]
    table = _table(f"Planner speed ({rows[0]['source']}, C={rows[0]['context_len']}, cp {rows[0]['cp']}, "
                   f"{rows[0]['num_seqs']} sequences, one core of {speed.get('cpus', '?')} visible; batch"
                   f"{' and Python' if referenced else ''}: per CPU-second, wall clock in brackets)", *columns)
    table.columns[0].min_width = max(len(r["strategy"]) for r in rows)  # specs in full, never cut
    for r in rows:
        cells = [r["strategy"], f"{r['numba_seqs_per_s']:,.0f}",
                 f"{r['kernel_seqs_per_cpu_s']:,.0f} ({r['kernel_seqs_per_s']:,.0f})",
                 f"{r['batch_seqs_per_cpu_s']:,.0f} ({r['batch_seqs_per_s']:,.0f})"]
        if referenced:
            python = r.get("python_seqs_per_s")
            cells += ["n/a" if python is None else f"{r['python_seqs_per_cpu_s']:,.2f} ({python:,.2f}; "
                      f"{r['python_seqs']} seqs)",
                      "n/a" if python is None else f"{r['speedup']:,.0f}x / {r['kernel_speedup']:,.0f}x",
                      "n/a" if r.get("python_matches") is None else ("yes" if r["python_matches"] else "NO")]
        table.add_row(*cells)
    _show(console, table)


def print_speed(console: Console, speed: dict, end_to_end: dict | None = None) -> None:
    """The planner speed table, and the end-to-end lines when given: ``print_report``'s speed sections."""
    _speed(console, speed)
    if end_to_end:
        _end_to_end(console, end_to_end)


def _end_to_end(console: Console, e2e: dict) -> None:
    console.print(f"Planner speed end to end: synth --no-tokens {e2e['num_seqs']:,} x {e2e['context_len']:,} "
                  f"{escape(e2e['source'])}: {e2e['synth_s']:.1f} s, {e2e['bytes'] / 2 ** 20:.1f} MiB")
    for p in e2e["plans"]:
        console.print(f"  plan --cp {e2e['cp']} --strategy {p['strategy']} --workers {p['workers']}: "
                      f"{p['seconds']:.1f} s ({p['seqs_per_s']:,.0f} seq/s end to end; read, plan, validate, "
                      f"write, {p['compared']:,} sequences compared with the baselines)")
    console.print(f"  verify ({e2e['verified_plans']} plans): {e2e['verify_s']:.1f} s")


def _runtime(console: Console, runtime: dict) -> None:
    table = _table(f"Runtime on CPU, MEASURED: cp_attention fwd+bwd on {runtime['cp']} gloo ranks, "
                   f"{runtime['source']} C={runtime['context_len']}, H={runtime['num_heads']} "
                   f"D={runtime['head_dim']} float32, reference kernels, {runtime['num_seqs']} seq x "
                   f"{runtime['reps']} steps", "strategy/comm", "step ms", f"vs {runtime['baseline']}",
                   "MB sent/rank", "projected ms (CPU model)", "projected ratio", "projected ratio (H100)")
    gpu_base = next(r for r in runtime["rows"] if r["case"] == runtime["baseline"])["gpu_projected_ms"]
    for r in runtime["rows"]:
        table.add_row(r["case"], f"{r['step_ms']:.1f}", f"{r['ratio']:.3f}", f"{r['sent_mb']:.2f}",
                      f"{r['projected_ms']:.1f}", f"{r['projected_ratio']:.3f}",
                      f"{r['gpu_projected_ms'] / gpu_base:.3f}")
    _show(console, table)
    for key, what in RANKINGS:
        ranking = runtime[key]
        if len(ranking["systems"]) < 2:
            continue
        verdict = "same order" if ranking["same_order"] else "orders differ"
        console.print(f"  {what}, fastest first, measured: {' < '.join(ranking['measured_order'])}")
        console.print(f"  {what}, fastest first, projected (CPU-calibrated model): "
                      f"{' < '.join(ranking['projected_order'])}")
        console.print(f"  {what}: {verdict}; rank correlation {ranking['spearman']:.2f}")
    ring = runtime.get("ring", {})
    if ring.get("ring_over_full"):
        console.print("  step time, ring / full comm on the same layout: " + ", ".join(
            f"{layout} {ratio:.2f}x" for layout, ratio in ring["ring_over_full"].items()))
    for system, over in ring.get("system_over", {}).items():
        if over:
            console.print(f"  {system} step time over: " + ", ".join(f"{k} {v:.2f}x" for k, v in over.items()))
    console.print(f"  rank correlation over all cases {runtime['spearman_all_cases']:.2f}")
    console.print(f"  the CPU-calibrated model accounts for {100 * runtime['projected_share']:.0f}% of the "
                  "measured step time of the collective cases; the remainder is not modelled")
    spread = runtime.get("comm_mode_spread")
    if spread is not None:
        console.print(f"  measurement spread: one plan under full / allgather / a2a differs by "
                      f"{100 * spread['step_ms']:.0f}% measured, {100 * spread['projected_ms']:.1f}% "
                      "projected "
                      "(median over strategies): smaller measured differences are noise on this machine")
    for line in CPU_RUNTIME_SCOPE:
        console.print(f"  {line}")


def _latency(console: Console, latency: dict) -> None:
    kind = "MEASURED attention + projected comm" if latency["measured"] else "PROJECTED"
    settings = latency["settings"]
    labels = list(settings[0]["systems"])
    for source in dict.fromkeys(s["source"] for s in settings):
        mine = [s for s in settings if s["source"] == source]
        table = _table(f"Step latency, {kind} ({latency['profile']}): speedup over Llama3 CP, "
                       f"{source} C={mine[0]['context_len']} (paper Figure 5)", "system",
                       *[f"cp{s['cp']} H{s['num_heads']}" for s in mine])
        for label in labels:
            table.add_row(label, *[f"{s['systems'][label]['speedup']:.2f}x" for s in mine])
        _show(console, table)
    cp, heads = max(s["cp"] for s in settings), max(s["num_heads"] for s in settings)
    for s in settings:
        if s["cp"] != cp or s["num_heads"] != heads:
            continue
        table = _table(f"Latency breakdown, {kind}, ms per layer fwd+bwd: {s['source']} cp{cp} H{heads} "
                       "(paper Figure 6)", "system", "attn fwd", "attn bwd", "comm (exposed)", "other",
                       "total", "comm mode", "MB sent/rank", "kernels/rank")
        for label, r in s["systems"].items():
            b = r["breakdown_ms"]
            table.add_row(label, f"{b['attn_fwd']:.2f}", f"{b['attn_bwd']:.2f}", f"{b['comm']:.2f}",
                          f"{b['other']:.2f}", f"{r['latency_ms']:.2f}", "/".join(r["comm_modes"]),
                          f"{r['comm_mb']:.0f}", f"{r['kernels']:.1f}")
        _show(console, table)
    sweep = latency["sweep"]
    if sweep["points"]:
        table = _table(f"Speedup over Llama3 CP against context length, PROJECTED: {sweep['source']} "
                       f"cp{sweep['cp']} H{sweep['num_heads']} (paper Figure 7)", "context",
                       *sweep["points"][0]["speedup"])
        for p in sweep["points"]:
            table.add_row(f"{p['context_len'] // 1024}K", *[f"{v:.2f}x" for v in p["speedup"].values()])
        _show(console, table)


def paper_comparison(results: dict) -> list[str]:
    """Lines comparing the paper's average speedups with ours, and why they differ."""
    latency = results.get("latency")
    if not latency or not latency["paper_averages"]:
        return []
    kind = "measured attention" if latency["measured"] else "projected"
    lines = [f"Paper vs this run (FlashCP speedup, average over settings; ours {kind}):"]
    for baseline, a in latency["paper_averages"].items():
        lines.append(f"  over {baseline}: paper {a['paper']:.2f}x, ours {a['ours']:.2f}x "
                     f"({a['settings']} settings)")
    imbalance = ""
    if results.get("quality"):
        llama = [r["imbalance_mean"] for r in results["quality"]["rows"] if r["strategy"] == "llama3"]
        imbalance = f" (mean Llama3 CP imbalance on our sequences: {np.mean(llama):.2f})" if llama else ""
    lines += [
        "Why the numbers differ:",
        "  - Ours is a per-layer model with public-spec bandwidths and a published kernel curve; the paper "
        "timed whole runs on 8 H100s. No NCCL inefficiency, framework overhead or non-attention layers here.",
        "  - The speedup over Llama3 CP tracks Llama3's workload imbalance" + imbalance + "; our sequences "
        "come from length distributions packed with truncation at the context length, not the paper's "
        "samples.",
        "  - Per-Doc CP pays here only for tile padding, one call overhead per part and its key gathers; the "
        "paper also measured costs of many small copies and transfers (its Figure 6 'Others') that this "
        "model does not charge, so Per-Doc CP looks stronger here than in the paper.",
        "  - The paper's averages include inference (forward only) and RedPajama; ours are training "
        f"(forward + backward) on {', '.join(dict.fromkeys(s['source'] for s in latency['settings']))}.",
    ]
    return lines


def print_report(results: dict, console: Console) -> None:
    """Print every scenario present in ``results``, then the paper comparison, the targets and the notes."""
    console.print(f"[bold]flashcp bench[/] {results['flashcp_version']} (torch {results['torch']}); "
                  f"profile: {results['profile']['name']}", markup=True)
    sections = {"quality": _quality, "ring-cost": _ring_cost, "dp": _dp, "speed": _speed,
                "end_to_end": _end_to_end, "runtime": _runtime, "latency": _latency}
    for name, show in sections.items():
        if results.get(name):
            show(console, results[name])
    for line in paper_comparison(results):
        console.print(line)
    latency = results.get("latency")
    quality = results.get("quality")
    if (latency and latency["targets"]) or (quality and quality.get("targets")):
        seqs = results.get("config", {}).get("num_seqs")
        console.print("targets, checked on this run's PROJECTED numbers"
                      + (f" ({seqs} sequence(s) per source: the fewer, the less a miss says)" if seqs else "")
                      + ":")
    if latency:
        for t in latency["targets"]:
            status = "[green]met[/]" if t["met"] else "[red]not met[/]"
            detail = f"; misses: {', '.join(t['misses'])}" if t["misses"] else ""
            console.print(f"target: {t['target']}: {status} (min {t['min_speedup']:.3f}x, mean "
                          f"{t['mean_speedup']:.3f}x){detail}", markup=True)
    for t in quality.get("targets", []) if quality else []:
        console.print(f"target: {escape(t['target'])}: {'[green]met[/]' if t['met'] else '[red]not met[/]'}",
                      markup=True)
    runtime = results.get("runtime")
    if runtime:
        for key, what in RANKINGS:
            ranking = runtime[key]
            if len(ranking["systems"]) >= 2:
                console.print(f"CPU check (not a GPU speed target): CPU-measured step time ranks the {what} "
                              "as the CPU-calibrated projection does: "
                              f"{'same order' if ranking['same_order'] else 'orders differ'} (rank "
                              f"correlation {ranking['spearman']:.2f})")
    for note in results["notes"]:
        console.print(f"note: {note}")
    seconds = results["seconds"]
    console.print("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
