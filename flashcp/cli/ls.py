"""``flashcp ls``: the dataset in one line and one line per plan (strategy, cp, quality, model, stale or not).

Plans are listed by cp (numerically), then strategy, then name; folders without a readable cp come last.
"""

from __future__ import annotations

import json

import click

from flashcp.cli.console import console, emit_json, set_json_output, warn
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.planner.plan_reader import PLAN_JSON, PLANS_DIR, PlanStore

__all__ = ["command", "list_dataset"]


def list_dataset(dataset: Dataset) -> dict:
    """The dataset's summary and one entry per plan folder: what ``ls`` prints (and ``--json`` returns)."""
    manifest = dataset.manifest
    problems = [p for p in map(dataset.file_problem, dataset.files) if p]
    tokenizer = manifest.get("tokenizer") or {}
    summary = {
        "path": str(dataset.root), "context_len": dataset.context_len, "sequences": dataset.num_sequences,
        "tokens": dataset.num_sequences * dataset.context_len, "data_files": len(dataset.files),
        "has_tokens": dataset.has_tokens, "created_by": manifest.get("created_by"),
        "tokenizer": tokenizer.get("name") if isinstance(tokenizer, dict) else None,
        "flashcp_version": manifest.get("flashcp_version"), "problems": problems,
    }
    plans = []
    plans_root = dataset.root / PLANS_DIR
    folders = sorted(p for p in plans_root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
        if plans_root.is_dir() and not plans_root.is_symlink() else []
    for folder in folders:
        entry: dict = {"name": folder.name}
        if not (folder / PLAN_JSON).is_file():
            plans.append({**entry, "status": "unfinished"})
            continue
        try:
            store = PlanStore(dataset, folder.name)
            status = "fresh"
        except FlashcpError as e:
            plans.append({**entry, "status": "stale" if "is stale" in str(e) else "damaged", "problem": str(e)})
            continue
        s = store.meta.get("summary") or {}
        plans.append({**entry, "status": status, "strategy": store.strategy, "cp": store.cp,
                      "params": store.meta.get("params"),
                      "model": None if store.model is None else store.model.name,
                      "model_description": store.describe_model(), "sequences": s.get("sequences"),
                      "imbalance_mean": s.get("imbalance_mean"), "imbalance_max": s.get("imbalance_max"),
                      "ag_saving_mean": s.get("ag_saving_mean"), "a2a_saving_mean": s.get("a2a_saving_mean")})
    plans.sort(key=lambda p: _plan_order(p, plans_root / p["name"]))
    return {"dataset": summary, "plans": plans}


def _plan_order(entry: dict, folder) -> tuple:
    """Sort key: cp (numerically), then strategy, then name; plans whose cp cannot be read go last.

    A stale or damaged plan's cp and strategy are read from its plan.json where they can be, so it lists
    beside its peers.
    """
    cp, strategy = entry.get("cp"), entry.get("strategy")
    if cp is None and entry["status"] in ("stale", "damaged"):
        try:
            meta = json.loads((folder / PLAN_JSON).read_text())
            cp, strategy = int(meta["cp"]), str(meta["strategy"])
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
            cp, strategy = None, None
    return (cp is None, cp or 0, strategy or "", entry["name"])


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@click.command("ls")
@click.argument("data", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON on stdout (text on stderr).")
def command(data: str, as_json: bool) -> None:
    """List DATA: its sequences and data files, and every plan with its strategy, cp, quality and freshness."""
    set_json_output(as_json)
    dataset = Dataset(data, check_files=False)
    listing = list_dataset(dataset)
    if as_json:
        emit_json(listing)
    d = listing["dataset"]
    kind = f"tokenizer {d['tokenizer']}" if d["has_tokens"] else "lengths only"
    console.print(f"{d['path']}: {d['sequences']:,} sequences of {d['context_len']:,} tokens in "
                  f"{d['data_files']} data file(s) ({kind}; {d['created_by']})")
    for problem in d["problems"]:
        warn(problem)
    if not listing["plans"]:
        console.print("no plans; run 'flashcp plan'")
        return
    width = max(len(p["name"]) for p in listing["plans"])
    for p in listing["plans"]:
        name = p["name"].ljust(width)
        if "strategy" not in p:
            console.print(f"{name}  {p['status']}" + (f": {p['problem']}" if "problem" in p else ""))
            continue
        imbalance = "-" if p["imbalance_mean"] is None else \
            f"{p['imbalance_mean']:.4f} mean / {p['imbalance_max']:.4f} max"
        model = p["model"] or "no model recorded (H=32, H_kv=32 priced)"
        console.print(f"{name}  {p['strategy']:<9} cp {p['cp']:<3} {p['sequences'] or 0:>9,} sequences  "
                      f"imbalance {imbalance}  saving {_pct(p['ag_saving_mean'])} all-gather / "
                      f"{_pct(p['a2a_saving_mean'])} exact-need  model {model}  {p['status']}")
