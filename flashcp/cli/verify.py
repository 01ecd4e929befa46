"""``flashcp verify``: re-hash data files against the manifest and re-check every plan; exit 1 on trouble."""

from __future__ import annotations

import click

from flashcp.cli.console import console, progress, warn
from flashcp.data.dataset import Dataset
from flashcp.planner.store import PLAN_JSON, PLANS_DIR
from flashcp.planner.verify import verify_dataset


@click.command("verify")
@click.argument("data", type=click.Path())
def command(data: str) -> None:
    """Check DATA: data files against the manifest, every plan for staleness, coverage, tokens and metrics."""
    dataset = Dataset(data)
    plans = dataset.root / PLANS_DIR
    num_plans = len(list(plans.glob(f"[!.]*/{PLAN_JSON}"))) if plans.is_dir() else 0
    with progress("verifying", dataset.num_sequences * (1 + num_plans)) as advance:
        report = verify_dataset(data, progress=advance)
    for message in report.warnings:
        warn(message)
    console.print(f"ok: {report.data_files} data file(s), {report.sequences:,} sequences match the manifest")
    for name, rows in report.plans.items():
        console.print(f"ok: plan {name}: {rows:,} sequence plans cover every token once, give equal tokens "
                      "and store the recomputed metrics")
    if not report.plans:
        console.print("no plans to check")
