"""A snapshot of what flashcp computes, to prove that a refactor changed nothing: run it before and after, compare.

Hashes the plans of every strategy on fixed synthetic data (wlb, prolong, pile x cp 4/8/16, 100 sequences of
131,072 tokens, plus flashcp2 at effort 0, effort 2 and token slack 0.05) column by column, with their plan.json
(timings left out); the numbers of `flashcp bench --quick --json` that are not timings; and CPLoader batches
(tokens, positions, labels, attention meta) of three plans at dp 1 and 2 on every rank. It uses only the command
line and the public runtime API, so the same script runs on both sides of a move.

    python scripts/snapshot.py OUT.json WORKDIR      # WORKDIR keeps the data and plans between runs

WORKDIR's data and plans are reused only by the code that made them: the folder records a hash of the flashcp
package it was filled by (every source file, and the numpy, numba, pyarrow and torch versions), and a run of
any other code (the other side of a move) rebuilds them first, so that a before/after check with one WORKDIR
never compares a run with itself. A WORKDIR that this script did not make is refused, and only what the script
itself writes there is ever deleted. Without ``mtkahypar`` (an install without the ``hypergraph`` extra) the
``dcp`` plans are skipped, said at the start and recorded in the snapshot's ``skipped``.
"""

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from click.testing import CliRunner

import flashcp
from flashcp.cli import cli as flashcp_cli
from flashcp.errors import FlashcpError
from flashcp.outputs import (
    check_output,
    enclosing_dataset,
    is_marked,
    json_report,
    make_marked_dir,
    mark_dir,
    write_json_output,
)

REPORT = json_report("flashcp-snapshot", "a scripts/snapshot.py snapshot", option="OUT")
"""OUT is written only where nothing is or a snapshot was (flashcp.outputs)."""

STRATEGIES = ["llama3", "perdoc", "flashcp", "flashcp+", "ring", "magi", "ptrr", "dcp", "flashcp2"]
FLASHCP2_VARIANTS = [["--effort", "0"], ["--effort", "2"], ["--token-slack", "0.05"]]
VOLATILE = ("time", "seconds", "created", "elapsed", "wall", "cpu", "_s", "hash", "sha", "ms", "per_sec", "rate",
            "speedup")
"""Keys left out of plan.json and the bench report: timings, and what hashes or dates a file."""
NEW_META_FIELDS = ("ag_slot", "a2a_busiest")
"""CPAttnMeta fields added after the first snapshot (left out, so that snapshots stay comparable)."""
DISTS = ("wlb", "prolong", "pile")
STAMP = "snapshot-code.json"
"""The file in WORKDIR naming the code that filled it."""
MADE = (*(f"d-{dist}" for dist in DISTS), "tok", "bench.json", STAMP)
"""Everything this script writes in WORKDIR: what a rebuild deletes (a user's other files there stay)."""


def code_version() -> str:
    """A hash of the flashcp package imported here (every file but caches) and the libraries that compute."""
    digest = hashlib.sha256()
    package = Path(flashcp.__file__).resolve().parent
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".json"):
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for library in ("numpy", "numba", "pyarrow", "torch"):
        digest.update(f"{library} {importlib.metadata.version(library)}".encode())
    return digest.hexdigest()


def prepare_workdir(work: Path, version: str) -> bool:
    """Make WORKDIR ready for the code ``version``; True when it holds that code's data and plans to reuse.

    A new (or empty) WORKDIR is created and marked as this script's; one that is not marked (a user's folder, or one an
    older script filled) is refused with one sentence (SystemExit). One filled by other code is emptied of what
    this script wrote (``MADE``) before the run rebuilds it.
    """
    dataset = enclosing_dataset(work)
    if dataset is not None:
        raise SystemExit(f"error: WORKDIR {work} lies inside the dataset {dataset}; only pack, synth and plan "
                         "write a dataset: choose a folder outside it")
    if not work.exists():
        work.parent.mkdir(parents=True, exist_ok=True)
        make_marked_dir(work, "scripts/snapshot.py work folder")
    elif work.is_dir() and not work.is_symlink() and not any(work.iterdir()):
        mark_dir(work, "scripts/snapshot.py work folder")
    elif not is_marked(work):
        raise SystemExit(f"error: WORKDIR {work} was not made by scripts/snapshot.py (no .flashcp-made marker "
                         "inside), so its plans cannot be told apart from a user's: give a new folder")
    try:
        recorded = json.loads((work / STAMP).read_text()).get("code")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded == version:
        return True
    for name in MADE:
        path = work / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    (work / STAMP).write_text(json.dumps({"code": version}) + "\n")
    return False


def strategies_here() -> tuple[list[str], list[str]]:
    """The strategies this install can plan, and a note for each one skipped (``dcp`` without mtkahypar)."""
    if importlib.util.find_spec("mtkahypar") is not None:
        return list(STRATEGIES), []
    return [s for s in STRATEGIES if s != "dcp"], [
        "dcp: skipped, mtkahypar is not installed (pip install -e '.[hypergraph]' to include it)"]


def run(*args) -> str:
    result = CliRunner().invoke(flashcp_cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
    return result.output


def scrub(value):
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in sorted(value.items()) if not any(w in k.lower() for w in VOLATILE)}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def hash_plan(folder: Path) -> tuple[str, dict]:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.parquet")):
        table = pq.read_table(path)
        for name in table.column_names:
            digest.update(name.encode())
            for buffer in table.column(name).combine_chunks().buffers():
                if buffer is not None:
                    digest.update(buffer.to_pybytes())
    return digest.hexdigest(), json.loads((folder / "plan.json").read_text())


def hash_value(digest, value) -> None:
    if isinstance(value, torch.Tensor):
        digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    elif dataclasses.is_dataclass(value):
        for field in dataclasses.fields(value):
            if not field.name.startswith("_") and field.name not in NEW_META_FIELDS:
                digest.update(field.name.encode())
                hash_value(digest, getattr(value, field.name))
    elif isinstance(value, dict):
        for key in sorted(value):
            digest.update(str(key).encode())
            hash_value(digest, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            hash_value(digest, item)
    elif isinstance(value, np.ndarray):
        digest.update(value.tobytes())
    else:
        digest.update(repr(value).encode())


def main() -> None:
    from flashcp.runtime import CPLoader

    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/snapshot.py OUT.json WORKDIR")
    out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    try:  # flashcp.outputs.check_output, as the oldest side a snapshot compares has it
        check_output(out_path, REPORT)  # before any work: a user's file is never replaced
    except FlashcpError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    strategies, skipped = strategies_here()  # before any work too, not at dcp after minutes of it
    for note in skipped:
        print(note, flush=True)
    if prepare_workdir(work, code_version()):
        print(f"reusing {work}: its data and plans were made by this same code", flush=True)
    out: dict = {"format": "flashcp-snapshot"}
    if skipped:
        out["skipped"] = skipped
    for dist in DISTS:
        data = work / f"d-{dist}"
        if not data.exists():
            run("synth", data, "--dist", dist, "--num-seqs", 100, "--context-len", 131072, "--seed", 7, "--no-tokens",
                "-q")
        for cp in (4, 8, 16):
            runs = [(s, []) for s in STRATEGIES] + [("flashcp2", extra) for extra in FLASHCP2_VARIANTS]
            for i, (strategy, extra) in enumerate(runs):
                if strategy not in strategies:
                    continue
                name = f"p{cp}-{i}"
                if not (data / "plans" / name).exists():
                    run("plan", data, "--cp", cp, "--strategy", strategy, "--name", name, "--compare", 16, "-q",
                        *extra)
                digest, meta = hash_plan(data / "plans" / name)
                key = f"{dist} cp{cp} {strategy} {' '.join(extra)}"
                out[key] = {"plans": digest, "plan.json": scrub(meta)}
                print(key, digest[:16], flush=True)
    report = work / "bench.json"
    if not report.exists():
        run("bench", "--quick", "--dist", "wlb,pile", "--context-len", 16384, "--seqs", 2, "--cp", "2,4", "--heads",
            8, "--runtime-context-len", 256, "--runtime-cp", 2, "--json", report)
    out["bench"] = scrub(json.loads(report.read_text()))
    tokens = work / "tok"
    if not tokens.exists():
        run("synth", tokens, "--dist", "wlb", "--num-seqs", 6, "--context-len", 4096, "--seed", 3, "--vocab-size",
            1000, "-q")
        for strategy in ("flashcp2", "flashcp", "llama3"):
            run("plan", tokens, "--cp", 4, "--strategy", strategy, "-q")
    for strategy in ("flashcp2", "flashcp", "llama3"):
        for dp in (1, 2):
            for rank in range(4):
                digest = hashlib.sha256()
                for replica in range(dp):
                    for batch in CPLoader(tokens, f"cp4-{strategy}", rank=rank, world_size=4, dp_rank=replica,
                                          dp_size=dp, seed=5):
                        hash_value(digest, batch)
                out[f"loader {strategy} dp{dp} rank{rank}"] = digest.hexdigest()
    write_json_output(out_path, REPORT, out)
    print("wrote", out_path, len(out) - 1, "entries")


if __name__ == "__main__":
    main()
