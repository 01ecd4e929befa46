"""A snapshot of what flashcp computes, to prove that a refactor changed nothing: run it before and after, compare.

Hashes the plans of every strategy on fixed synthetic data (wlb, prolong, pile x cp 4/8/16, 100 sequences of
131,072 tokens, plus flashcp2 at effort 0, effort 2 and token slack 0.05) column by column, with their plan.json
(timings left out); the numbers of `flashcp bench --quick --json` that are not timings; and CPLoader batches
(tokens, positions, labels, attention meta) of three plans at dp 1 and 2 on every rank. It uses only the command
line and the public runtime API, so the same script runs on both sides of a move.

    python bench/snapshot.py OUT.json WORKDIR      # WORKDIR keeps the data and plans between runs
"""

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from click.testing import CliRunner

from flashcp.cli import cli as flashcp_cli
from flashcp.errors import FlashcpError
from flashcp.outputs import check_output, json_report, write_json_output

REPORT = json_report("flashcp-snapshot", "a bench/snapshot.py snapshot", option="OUT")
"""OUT is written only where nothing is or a snapshot was (flashcp.outputs)."""

STRATEGIES = ["llama3", "perdoc", "flashcp", "flashcp+", "ring", "magi", "ptrr", "dcp", "flashcp2"]
FLASHCP2_VARIANTS = [["--effort", "0"], ["--effort", "2"], ["--token-slack", "0.05"]]
VOLATILE = ("time", "seconds", "created", "elapsed", "wall", "cpu", "_s", "hash", "sha", "ms", "per_sec", "rate",
            "speedup")
"""Keys left out of plan.json and the bench report: timings, and what hashes or dates a file."""
NEW_META_FIELDS = ("ag_slot", "a2a_busiest")
"""CPAttnMeta fields added after the first snapshot (left out, so that snapshots stay comparable)."""


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
        sys.exit("usage: python bench/snapshot.py OUT.json WORKDIR")
    out_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    try:
        check_output(out_path, REPORT)  # before any work: a user's file is never replaced
    except FlashcpError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    work.mkdir(parents=True, exist_ok=True)
    out: dict = {"format": "flashcp-snapshot"}
    for dist in ("wlb", "prolong", "pile"):
        data = work / f"d-{dist}"
        if not data.exists():
            run("synth", data, "--dist", dist, "--num-seqs", 100, "--context-len", 131072, "--seed", 7, "--no-tokens",
                "-q")
        for cp in (4, 8, 16):
            runs = [(s, []) for s in STRATEGIES] + [("flashcp2", extra) for extra in FLASHCP2_VARIANTS]
            for i, (strategy, extra) in enumerate(runs):
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
