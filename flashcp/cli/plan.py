"""``flashcp plan``: shard every sequence of a dataset and write ``plans/cp{N}-{strategy}/``."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import click
from click.core import ParameterSource
from rich import box
from rich.table import Table

from flashcp.cli.console import console, emit_json, info, progress, set_json_output
from flashcp.cli.options import engine_options
from flashcp.costmodel.models import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.planner.compare import BASELINES, COMPARE_DEFAULT
from flashcp.planner.pipeline import plan_dataset
from flashcp.planner.registry import DEFAULT_STRATEGY, STRATEGIES

COLUMNS = ("strategy", "seqs", "imb", "p50", "max", "AG", "EN")
"""Short column names (a legend line explains them), so the table never needs cutting."""


def summary_table(rows: list[tuple[str, dict]], *, priced: bool, split_after_first: bool = False) -> Table:
    """Imbalance, comm savings and (``priced``) projected step time, one row per ``(strategy, summary)``.

    ``split_after_first`` draws a line under the first row (the plan over every sequence, the rest over the
    compared ones).
    """
    table = Table(box=box.SQUARE, show_edge=False)
    for head in COLUMNS + (("step ms",) if priced else ()):
        table.add_column(head, justify="left" if head == "strategy" else "right", no_wrap=True)
    for index, (name, s) in enumerate(rows):
        if not s.get("sequences"):
            continue
        cells = [name, f"{s['sequences']:,}", f"{s['imbalance_mean']:.4f}", f"{s['imbalance_p50']:.4f}",
                 f"{s['imbalance_max']:.4f}", f"{100 * s['ag_saving_mean']:.1f}%", f"{100 * s['a2a_saving_mean']:.1f}%"]
        if priced:
            step = s.get("step_seconds_mean")
            cells.append("-" if step is None else f"{1e3 * step:.3f}")
        table.add_row(*cells, end_section=split_after_first and index == 0)
    return table


def summary_lines(meta: dict) -> tuple[list[tuple[str, dict]], list[str], bool]:
    """What ``plan`` prints under its title: the table's rows, the legend and reading lines, split or not.

    Split: the first row (the plan over every sequence) stands above the compared ones.
    """
    summary, strategy = meta["summary"], meta["strategy"]
    compare = summary.get("compare") or {}
    legend = ("imb, p50, max: mean, median and largest max/mean rank workload; AG, EN: all-gather and "
              "exact-need saving against a full K/V all-gather")
    kinds = _kinds_note(meta.get("model"))
    if not compare.get("sequences"):
        return [(strategy, summary)], [legend] + kinds, False
    model = compare["model"]
    recurrent = model.get("recurrent")
    beside = f" and {recurrent['num_layers']} recurrent {recurrent['kind']} layer(s)" if recurrent else ""
    legend += (f"; step ms: projected step time per sequence ({compare['profile']}; {model['layers']} layer(s) "
               f"of H={model['num_heads']}, H_kv={model['num_kv_heads']}, D={model['head_dim']}{beside}), the "
               "baselines' layouts priced with the same sharding-aware exchange (their own frameworks gather all "
               "K/V: 0%)")
    compared = [(strategy, compare["strategy"])] + [(name, s) for name, s in summary["baselines"].items()
                                                    if name != strategy]
    sampled = compare["sequences"] < summary["sequences"]
    rows = [(strategy, summary)] + compared if sampled else compared
    return rows, [legend, *kinds, _reading(compared, compare, sampled)], sampled


def _kinds_note(model: dict | None) -> list[str]:
    """The line naming the window and chunk layers priced by their own kind (none without them)."""
    runs: dict[str, int] = {}
    for run in (model or {}).get("layers", []):
        name = run["kind"] if run.get("size") is None else f"{run['kind']} {run['size']}"
        runs[name] = runs.get(name, 0) + run["count"]
    if set(runs) <= {"full"}:
        return []
    kinds = ", ".join(f"{count} {name}" for name, count in runs.items())
    return [f"layer kinds: priced by kind ({kinds}): each with its own work and exact-need exchange"]


def _reading(compared: list[tuple[str, dict]], compare: dict, sampled: bool) -> str:
    """One line saying which strategy is fastest by projected step time, and by how much."""
    steps = {name: s["step_seconds_mean"] for name, s in compared if s.get("step_seconds_mean") is not None}
    fastest = min(steps, key=steps.__getitem__)
    slower = "".join(f", {name} takes {steps[name] / steps[fastest]:.2f}x as long" for name in steps
                     if name != fastest)
    where = f"the same {compare['sequences']:,} sequences (one in {compare['every_nth_sequence']:,}, the rows " \
        "under the line)" if sampled else f"these {compare['sequences']:,} sequences"
    return f"projected step time on {where}: {fastest} is fastest{slower}"


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
@click.option("--model", "model_name", default=DEFAULT_MODEL, show_default=True, metavar="NAME|CONFIG",
              help=f"The model every price is made for (flashcp2's objective, seq_cost, the comparison): one of "
                   f"{', '.join(BUILTIN_MODELS)}, or a Hugging Face config.json (or a folder holding one).")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="magi, ptrr: chunk tokens [default: 512 for magi, 128 for ptrr].")
@click.option("--compare", type=click.IntRange(min=0), default=COMPARE_DEFAULT, show_default=True,
              help=f"Sequences (evenly spaced) also planned with the baselines {' and '.join(BASELINES)} for the "
                   "summary, every plan priced by projected step time; 0 skips the comparison.")
@click.option("--workers", type=int, default=1, show_default=True, help="Worker processes.")
@click.option("--name", default=None, help="Plan folder name [default: cp{N}-{strategy}].")
@click.option("--force", is_flag=True, help="Replace an existing plan of the same name (one made from this data "
                                            "with the same parameters is kept without it).")
@click.option("--json", "as_json", is_flag=True, help="Print plan.json and the time on stdout (text on stderr).")
@engine_options("Plan here, or one Ray task per data file (the same bytes; needs pip install 'flashcp[ray]').")
def command(data: str, cp: int, strategy: str, target_imbalance: float | None, objective: str | None,
            profile: str | None, effort: str | None, token_slack: float | None, topology: str | None,
            model_name: str, chunk_size: int | None, compare: int, workers: int, name: str | None, force: bool,
            as_json: bool = False,
            engine: str = "local", ray_address: str | None = None) -> None:
    """Plan every sequence of DATA for CP size N; every plan is validated before it is written."""
    set_json_output(as_json)
    started = time.perf_counter()
    model = resolve_model(model_name)  # a bad name or config fails before anything is read or written
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

        def on_note(note: str) -> None:
            info(note)
            if note.startswith("compiling planner kernels"):  # the bar would sit at 0 through the compile
                advance.describe(f"planning cp{cp} {strategy}: compiling the planner kernels (once; later runs "
                                 "load them from the cache)", until_advance=True)

        result = plan_dataset(data, cp, strategy, target_imbalance=target_imbalance, workers=workers,
                              force=force, name=name, progress=advance, on_note=on_note,
                              overrides={k: v for k, v in overrides.items() if v is not None},
                              run_jobs=run_jobs, compare=compare, model=model)
    elapsed = time.perf_counter() - started
    meta = result.meta
    if as_json:
        emit_json({"dataset": str(dataset.root), "plan": meta, "seconds": elapsed,
                   "up_to_date": result.up_to_date})
    summary = meta["summary"]
    params = ", ".join(f"{k}={v}" for k, v in meta["params"].items() if v is not None)
    if result.up_to_date:
        info(f"{dataset.root}/plans/{meta['name']}/ is up to date (made from this data with the same "
             "parameters); nothing to do, --force makes it again")
    else:
        info(f"wrote {dataset.root}/plans/{meta['name']}/ ({len(meta['plan_files'])} plan file(s), "
             f"{summary['sequences']:,} sequences, all validated) in {elapsed:.1f}s")
    title = (f"cp{cp} over {summary['sequences']:,} sequences of {dataset.context_len:,} tokens "
             f"({meta['strategy']}{': ' + params if params else ''})")
    rows, notes, split = summary_lines(meta)
    table = summary_table(rows, priced=bool(summary.get("compare", {}).get("sequences")),
                          split_after_first=split)
    console.print(title)
    console.print(f"priced for {model.describe()}")
    # never cut: off a terminal the console is 80 columns wide, narrower than the table may be
    console.print(table, width=max(console.width, console.measure(table).maximum), crop=False)
    if "topology" in summary:
        t = summary["topology"]
        console.print(f"{t['gpus_per_node']} ranks per node: the busiest rank receives "
                      f"{t['a2a_intra_node_received_pct']:.1f}% inside its node and "
                      f"{t['a2a_inter_node_received_pct']:.1f}% from other nodes (of (N-1)C/N, mean over sequences)")
    for line in notes:
        console.print(line)
