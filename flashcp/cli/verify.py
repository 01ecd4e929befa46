"""``flashcp verify``: re-hash data files against the manifest and re-check every plan; exit 1 on trouble."""

from __future__ import annotations

import click

from flashcp.cli.console import console, emit_json, error, progress, set_json_output, warn
from flashcp.data.dataset import Dataset
from flashcp.planner.plan_reader import PLAN_JSON, PLANS_DIR
from flashcp.planner.verify import verify_dataset


@click.command("verify")
@click.argument("data", type=click.Path())
@click.option("--fast", is_flag=True,
              help="Check only sizes and Parquet footer fingerprints (what every reader checks), no hashes.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout (text on stderr).")
def command(data: str, fast: bool, as_json: bool) -> None:
    """Check DATA: data files against the manifest, every plan for staleness, coverage, tokens and metrics.

    Every problem found is printed (one line each) and the exit code is 1 when there is any.
    """
    set_json_output(as_json)
    dataset = Dataset(data, check_files=False)
    plans = dataset.root / PLANS_DIR
    num_plans = len(list(plans.glob(f"[!.]*/{PLAN_JSON}"))) if plans.is_dir() else 0
    with progress("verifying", dataset.num_sequences * (1 + num_plans)) as advance:
        report = verify_dataset(data, progress=advance, fast=fast)
    if as_json:  # a failed check is a failure too: "ok" false and the first problem as "error"
        emit_json({**report.to_json(), **({"error": report.problems[0]} if report.problems else {})})
    for message in report.warnings:
        warn(message)
    how = "sizes and footers match" if fast else "match"
    if report.data_files == len(dataset.files):
        console.print(f"ok: {report.data_files} data file(s), {report.sequences:,} sequences {how} the manifest")
    for name, rows in report.plans.items():
        console.print(f"ok: plan {name}: " + (f"fresh, {rows:,} sequence plans, every plan file present"
                                              if fast else f"{rows:,} sequence plans cover every token once, "
                                              "give equal tokens and store the recomputed metrics"))
    if not report.plans and not num_plans:
        console.print("no plans to check")
    for problem in report.problems:
        error(problem)
    if report.problems:
        raise SystemExit(1)
