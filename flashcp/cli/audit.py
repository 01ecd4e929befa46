"""``flashcp audit DATA --plan NAME --ilp``: solve sampled sequences with CP-SAT, compare with the plan."""

from __future__ import annotations

import math
from pathlib import Path

import click
from rich.table import Table

from flashcp.cli.console import console, info, progress, warn
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.outputs import check_output, json_report, write_json_output
from flashcp.planner.ilp.audit import SequenceAudit, audit_plan, sample_rows, summarize, write_audit_plan
from flashcp.planner.ilp.model import IlpOptions
from flashcp.planner.plan_reader import PlanStore
from flashcp.planner.plan_writer import PlanSlot

AUDIT_REPORT = json_report("flashcp-audit", "a flashcp audit report",
                           legacy=lambda v: {"dataset", "plan", "options", "summary", "sequences"} <= set(v))
"""``flashcp audit --json FILE`` (reports written before they carried ``format``: by their keys)."""


@click.command("audit")
@click.argument("data", type=click.Path(path_type=Path))
@click.option("--plan", "plan_name", required=True, help="Plan folder to audit, e.g. cp4-flashcp.")
@click.option("--ilp", is_flag=True,
              help="Accepted for compatibility: the CP-SAT audit is the one audit and always runs.")
@click.option("--samples", default=20, show_default=True, type=click.IntRange(min=1),
              help="Sequences to sample.")
@click.option("--seed", default=0, show_default=True, help="Seed of the sample and of CP-SAT.")
@click.option("--time-limit", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="CP-SAT seconds per sequence.")
@click.option("--granularity", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Block size in tokens: documents are cut into blocks of this size.")
@click.option("--plan-cuts", is_flag=True,
              help="Also cut blocks where the audited plan cuts: the ILP starts from the plan itself.")
@click.option("--comm-weight", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Objective: imbalance + WEIGHT * max_comm / (C/N).")
@click.option("--lexicographic", is_flag=True, help="Minimise imbalance first, then comm at that imbalance.")
@click.option("--match-imbalance", is_flag=True,
              help="Cap each rank's workload at the plan's own maximum and minimise comm only.")
@click.option("--workers", default=0, show_default=True, type=click.IntRange(min=0),
              help="CP-SAT search workers (0: every core).")
@click.option("--json", "json_path", type=click.Path(path_type=Path),
              help="Write per-sequence results here (a flashcp audit report there is replaced; anything else is "
                   "refused).")
@click.option("--write-plan", help="Write the ILP plans as plans/NAME (other rows keep the audited plan).")
@click.option("--force", is_flag=True, help="Replace an existing --write-plan folder.")
def command(data: Path, plan_name: str, ilp: bool, samples: int, seed: int, time_limit: float,
            granularity: int, plan_cuts: bool, comm_weight: float, lexicographic: bool, match_imbalance: bool,
            workers: int, json_path: Path | None, write_plan: str | None, force: bool) -> None:
    """Compare a plan with CP-SAT's exact sharding of sampled sequences (paper Table 2)."""
    for option, value in (("--time-limit", time_limit), ("--comm-weight", comm_weight)):
        if not math.isfinite(value):
            raise FlashcpError(f"{option} must be a finite number, got {value}")
    if json_path is not None:
        check_output(json_path, AUDIT_REPORT)
    if lexicographic and match_imbalance:
        raise FlashcpError("--lexicographic and --match-imbalance exclude each other: "
                           "--match-imbalance already fixes the imbalance and minimises comm only")
    dataset = Dataset(data)
    store = PlanStore(dataset, plan_name)
    if granularity > dataset.context_len:
        raise FlashcpError(f"--granularity {granularity} is larger than the context length "
                           f"{dataset.context_len}; choose at most {dataset.context_len}")
    if write_plan is not None:  # every check on the name and the folder before the solving starts
        if write_plan == plan_name:
            raise FlashcpError(f"--write-plan {write_plan} would overwrite the plan being audited; choose "
                               "another name")
        PlanSlot(dataset, write_plan, force=force, what="--write-plan").release()
    options = IlpOptions(granularity=granularity, comm_weight=comm_weight, lexicographic=lexicographic,
                         time_limit_s=time_limit, num_workers=workers, seed=seed, hint_cuts=plan_cuts)
    rows = sample_rows(dataset.num_sequences, samples, seed)
    objective = ("comm at the plan's own max workload" if match_imbalance else
                 "imbalance, then comm" if lexicographic else f"imbalance + {comm_weight:g} x comm ratio")
    grid = f"granularity {granularity}" + (" + the plan's cuts" if plan_cuts else "")
    info(f"auditing plan '{plan_name}' of {data}: {rows.size} of {dataset.num_sequences} sequences, "
         f"cp {store.cp}, {grid}, time limit {time_limit:g} s, objective: {objective}")

    with progress("solving", rows.size) as advance:
        def done(audit: SequenceAudit) -> None:
            r = audit.result
            info(f"row {audit.row}: {r.status}, {r.num_blocks} blocks, {r.wall_s:.1f} s", level=2)
            advance()

        audits = audit_plan(dataset, store, rows, options, match_imbalance=match_imbalance, on_done=done)

    cp, context_len = store.cp, dataset.context_len
    summary = summarize(audits, context_len, cp)
    console.print(_table(summary, plan_name, grid, time_limit))
    for audit in audits:
        if note := audit.note(granularity):
            warn(f"row {audit.row}: {note}")

    params = {"granularity": granularity, "plan_cuts": plan_cuts, "comm_weight": comm_weight,
              "lexicographic": lexicographic, "match_imbalance": match_imbalance, "time_limit_s": time_limit,
              "seed": seed, "samples": samples}
    if json_path is not None:
        write_json_output(json_path, AUDIT_REPORT, {
            "format": "flashcp-audit", "dataset": str(data), "plan": plan_name, "cp": cp, "context_len": context_len,
            "options": params, "summary": summary,
            "sequences": [a.to_json(context_len, cp, granularity) for a in audits]})
        info(f"wrote {json_path}")
    if write_plan is not None:
        meta = write_audit_plan(dataset, store, audits, write_plan, params=params, force=force)
        ilp_rows = meta["summary"]["ilp_sequences"]
        info(f"wrote plan '{write_plan}': {ilp_rows} ILP rows, the other "
             f"{meta['summary']['sequences'] - ilp_rows} from '{plan_name}'")


def _table(summary: dict, plan_name: str, grid: str, time_limit: float) -> Table:
    """The paper's Table 2: ILP against the heuristic, then the solver's own numbers."""
    n, k = summary["valid"], summary["samples"]
    table = Table(title=f"ILP ({grid}, {time_limit:g} s limit) vs '{plan_name}': "
                        f"means over {n} of {k} sequences with a valid ILP plan")
    table.add_column("metric")
    table.add_column("ILP solver", justify="right")
    table.add_column("heuristic", justify="right")

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    def ratio(x):
        return "-" if x is None else f"{x:.3f}"

    ilp, heur = summary["ilp"], summary["heuristic"]
    table.add_row("communication saving (all-gather)", pct(ilp["comm_saving"]), pct(heur["comm_saving"]))
    table.add_row("workload imbalance ratio", ratio(ilp["imbalance"]), ratio(heur["imbalance"]))
    diff = summary["comm_saving_gap_pp"]
    table.add_row("comm saving, ILP - heuristic", "-" if diff is None else f"{diff:+.1f} pp", "")
    table.add_row("communication saving (exact-need)", pct(ilp["a2a_comm_saving"]),
                  pct(heur["a2a_comm_saving"]))
    solve = "-" if summary["solve_s_mean"] is None else (
        f"{summary['solve_s_mean']:.1f} s / {summary['solve_s_max']:.1f} s")
    table.add_row("solve time (mean / max)", solve, "")
    gap = "-" if summary["gap_mean"] is None else f"{pct(summary['gap_mean'])} / {pct(summary['gap_max'])}"
    table.add_row("optimality gap (mean / max)", gap, "")
    table.add_row("proven optimal", f"{summary['optimal']} / {n}", "")
    table.caption = ("savings against a full K/V all-gather: all-gather = 1 - max contribution / (C/N); "
                     "exact-need = 1 - max received / ((N-1)C/N); gap = (objective - CP-SAT bound) / "
                     "max(1, objective): relative for imbalance + weight x comm, points of saving for comm alone")
    if summary["quota_relaxed"] or summary["no_solution"]:
        table.caption += (f"\n{summary['quota_relaxed']} solved only with relaxed quotas, "
                          f"{summary['no_solution']} without a plan: not averaged")
    return table
