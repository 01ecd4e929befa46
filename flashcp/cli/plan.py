"""``flashcp plan``: shard every sequence of a dataset and write ``plans/cp{N}-{strategy}/``."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import click
from click.core import ParameterSource
from rich.table import Table

from flashcp.cli.console import console, emit_json, info, progress, set_json_output
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.planner.pipeline import plan_dataset
from flashcp.planner.strategies import DEFAULT_STRATEGY, STRATEGIES


def summary_table(title: str, rows: dict[str, dict]) -> Table:
    """A table of imbalance and comm savings, one row per strategy summary."""
    table = Table(title=title, title_justify="left")
    table.add_column("strategy")
    table.add_column("sequences", justify="right")
    for head in ("imbalance mean", "p50", "max", "all-gather saving", "exact-need saving"):
        table.add_column(head, justify="right")
    for name, s in rows.items():
        if not s.get("sequences"):
            continue
        table.add_row(name, f"{s['sequences']:,}", f"{s['imbalance_mean']:.4f}", f"{s['imbalance_p50']:.4f}",
                      f"{s['imbalance_max']:.4f}", f"{100 * s['ag_saving_mean']:.1f}%",
                      f"{100 * s['a2a_saving_mean']:.1f}%")
    return table


@click.command("plan")
@click.argument("data", type=click.Path())
@click.option("--cp", "cp", type=int, required=True, help="CP size N (ranks per sequence).")
@click.option("--strategy", default=DEFAULT_STRATEGY, show_default=True,
              help=f"One of: {', '.join(STRATEGIES)}.")
@click.option("--target-imbalance", type=float, default=None,
              help="Target max/mean workload R (flashcp: 1.05, flashcp+: 1.01 by default); for flashcp2 a "
                   "ceiling (default 1.05): inside it the projected step time decides.")
@click.option("--objective", type=click.Choice(["time"]), default=None,
              help="flashcp2: what the search minimises (time = projected step time) [default: time].")
@click.option("--profile", type=click.Path(dir_okay=False), default=None,
              help="flashcp2: hardware profile JSON for the objective [default: the bench's H100 profile].")
@click.option("--effort", default=None,
              help="flashcp2: local-search budget per sequence, 16 objective evaluations per unit "
                   "[default: 1; 0 = a smaller portfolio, no search]; 'ilp' or 'ilp:SECONDS' then polishes "
                   "every sequence with CP-SAT (10 s each by default).")
@click.option("--token-slack", type=click.FloatRange(min=0, max=1, max_open=True), default=None,
              help="flashcp2: a rank may hold up to F x C/N tokens more or fewer than its quota, the objective "
                   "pricing the per-token layers too [default: 0, exact quotas].")
@click.option("--topology", default=None, metavar="NODESxGPUS",
              help="flashcp2: the CP ranks' layout, e.g. 2x8 (rank r on node r // GPUS): inter-node K/V is "
                   "priced at the profile's inter_node_gbps and reported apart [default: the profile's].")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="magi, ptrr: chunk tokens [default: 512 for magi, 128 for ptrr].")
@click.option("--workers", type=int, default=1, show_default=True, help="Worker processes.")
@click.option("--name", default=None, help="Plan folder name [default: cp{N}-{strategy}].")
@click.option("--force", is_flag=True, help="Replace an existing plan of the same name.")
@click.option("--json", "as_json", is_flag=True, help="Print plan.json and the time on stdout (text on stderr).")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Plan here, or one Ray task per data file (the same bytes; needs pip install 'flashcp[ray]').")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="With --engine ray: join the cluster at ADDRESS ('auto': the running one) instead of "
                   "starting Ray on this machine with --workers CPUs.")
def command(data: str, cp: int, strategy: str, target_imbalance: float | None, objective: str | None,
            profile: str | None, effort: str | None, token_slack: float | None, topology: str | None,
            chunk_size: int | None, workers: int, name: str | None, force: bool, as_json: bool = False,
            engine: str = "local", ray_address: str | None = None) -> None:
    """Plan every sequence of DATA for CP size N; every plan is validated before it is written."""
    set_json_output(as_json)
    started = time.perf_counter()
    dataset = Dataset(data)
    if ray_address is not None and engine != "ray":
        raise FlashcpError("--ray-address needs --engine ray")
    with ExitStack() as stack:
        run_jobs: Callable | None = None
        if engine == "ray":
            from flashcp.engines.ray_cluster import ray_session
            from flashcp.engines.ray_plan import run_jobs as ray_run_jobs

            run_jobs = ray_run_jobs
            explicit = click.get_current_context().get_parameter_source("workers") != ParameterSource.DEFAULT
            stack.enter_context(ray_session(ray_address, workers if explicit else None))  # default: all cores
        advance = stack.enter_context(progress(f"planning cp{cp} {strategy}", dataset.num_sequences))
        overrides = {"objective": objective, "profile": str(Path(profile).resolve()) if profile else None,
                     "effort": int(effort) if effort and effort.isdigit() else effort, "chunk_size": chunk_size,
                     "token_slack": token_slack, "topology": topology}
        meta = plan_dataset(data, cp, strategy, target_imbalance=target_imbalance, workers=workers,
                            force=force, name=name, progress=advance, on_note=info,
                            overrides={k: v for k, v in overrides.items() if v is not None}, run_jobs=run_jobs)
    elapsed = time.perf_counter() - started
    if as_json:
        emit_json({"dataset": str(dataset.root), "plan": meta, "seconds": elapsed})
    summary = meta["summary"]
    params = ", ".join(f"{k}={v}" for k, v in meta["params"].items() if v is not None)
    info(f"wrote {dataset.root}/plans/{meta['name']}/ ({len(meta['plan_files'])} plan file(s), "
         f"{summary['sequences']:,} sequences, all validated) in {elapsed:.1f}s")
    step = summary["baselines_every_nth_sequence"]
    sampled = "" if step == 1 else f"; baselines on every {step}th sequence"
    title = (f"cp{cp} over {summary['sequences']:,} sequences of {dataset.context_len:,} tokens "
             f"({meta['strategy']}{': ' + params if params else ''}{sampled})")
    console.print(summary_table(title, {meta["strategy"]: summary, **summary["baselines"]}))
    if "topology" in summary:
        t = summary["topology"]
        console.print(f"{t['gpus_per_node']} ranks per node: the busiest rank receives "
                      f"{t['a2a_intra_node_received_pct']:.1f}% inside its node and "
                      f"{t['a2a_inter_node_received_pct']:.1f}% from other nodes (of (N-1)C/N, mean over sequences)")
    console.print("savings are against a full K/V all-gather: all-gather = 1 - max contribution / (C/N), "
                  "exact-need = 1 - max received / ((N-1)C/N); the llama3 and perdoc rows price their plans "
                  "with the same sharding-aware exchange (their own frameworks gather all K/V: 0%)")
