"""The fault suite, SIGKILL part: ``pack --force`` and ``plan`` killed at several points, then re-run.

A kill before the swap leaves the old dataset or plan byte-identical; a kill during it is finished or rolled
back by the next run; every re-run ends with the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.workspace import ROOT, copy_tree, docs, one_sentence, pack_args, run, tree, write_jsonl

KILLER = """
import importlib, os, signal, sys
owner = importlib.import_module(os.environ["KILL_MODULE"])
cls, _, name = os.environ["KILL_ATTR"].partition(":")
target = getattr(owner, cls) if name else owner
name = name or cls
original, calls = getattr(target, name), [0]
def wrapper(*args, **kwargs):
    match = os.environ["KILL_MATCH"]
    if not match or str(args[0]).endswith(match):
        calls[0] += 1
    hit = calls[0] == int(os.environ["KILL_AT"])
    if hit and os.environ["KILL_WHEN"] == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = original(*args, **kwargs)
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
setattr(target, name, wrapper)
from flashcp.cli import cli
cli(sys.argv[1:], prog_name="flashcp")
"""


def killed(args, module: str, attr: str, at: int, *, when: str = "before", match: str = "") -> None:
    """Run ``flashcp ARGS`` in a child that SIGKILLs itself at the ``at``-th call of ``module.attr``.

    ``attr`` is a function name or ``Class:method``; with ``match`` only calls whose first argument ends
    with it count; ``when`` is ``before`` or ``after`` the call.
    """
    env = {**os.environ, "KILL_MODULE": module, "KILL_ATTR": attr, "KILL_AT": str(at), "KILL_WHEN": when,
           "KILL_MATCH": match, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", KILLER, *map(str, args)], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr


@pytest.fixture
def ws(tmp_path):
    """An old dataset with a plan; new inputs; and the reference pack of the new inputs and its plan."""
    write_jsonl(tmp_path / "old.jsonl", docs(30))
    write_jsonl(tmp_path / "new.jsonl", docs(50, seed=3))
    assert run(*pack_args(tmp_path / "old.jsonl", tmp_path / "data")).exit_code == 0
    assert run("plan", tmp_path / "data", "--cp", 2, "--strategy", "flashcp").exit_code == 0
    assert run(*pack_args(tmp_path / "new.jsonl", tmp_path / "reference")).exit_code == 0
    assert run("plan", tmp_path / "reference", "--cp", 2, "--strategy", "flashcp",
               "--target-imbalance", 1.2).exit_code == 0
    return tmp_path


def _without_plans(root: Path) -> dict[str, str]:
    return {k: v for k, v in tree(root).items() if not k.startswith("plans")}


@pytest.mark.parametrize("at", [1, 5])
def test_force_pack_killed_while_building(ws, at):
    old = tree(ws / "data")
    args = pack_args(ws / "new.jsonl", ws / "data", "--force")
    killed(args, "flashcp.data.dataset", "DataFileWriter:write", at)
    assert {k: v for k, v in tree(ws / "data").items() if not k.startswith(".flashcp-replacement")} == old
    assert run("verify", ws / "data").exit_code == 0  # readers see the old dataset, whole
    result = run(*args)
    assert result.exit_code == 0, result.output
    if at > 2:
        assert "of them in this run" in result.stdout  # tokens/s counts this run's tokens only
    assert tree(ws / "data") == _without_plans(ws / "reference")  # the old dataset's plans went with it


def test_force_pack_killed_during_the_swap(ws):
    old = tree(ws / "data")
    args = pack_args(ws / "new.jsonl", ws / "data", "--force")
    killed(args, "os", "replace", 1, match=".flashcp-replacement/data")  # the old one is moved aside
    one_sentence(run("show", ws / "data"), "an interrupted 'flashcp pack --force' was replacing it")
    result = run(*pack_args(ws / "old.jsonl", ws / "data"))  # the old command: rolled back, nothing to do
    assert result.exit_code == 0 and "put back the dataset" in result.stderr
    assert "already holds this dataset" in result.stdout
    assert {k: v for k, v in tree(ws / "data").items() if not k.startswith(".flashcp-replacement")} == old
    result = run(*args)  # the new command finds its finished replacement and swaps it in
    assert result.exit_code == 0 and "finished the replacement" in result.stderr
    assert tree(ws / "data") == _without_plans(ws / "reference")


@pytest.mark.parametrize("point", ["building", "after the swap"])
def test_plan_killed_then_rerun(ws, tmp_path, point):
    data = ws / "reference"
    old = tree(data / "plans" / "cp2-flashcp")
    args = ["plan", data, "--cp", 2, "--strategy", "flashcp", "--force"]  # replaces the 1.2 plan with the default 1.05
    if point == "building":
        killed(args, "flashcp.planner.plan_writer", "PlanFileWriter:write", 2)
        assert tree(data / "plans" / "cp2-flashcp") == old
        assert run("show", data, "--plan", "cp2-flashcp").exit_code == 0
    else:
        killed(args, "flashcp.planner.plan_writer", "replace_dir", 1, when="after")
        assert tree(data / "plans" / "cp2-flashcp") != old  # the new plan is in place
    leftovers = [p.name for p in (data / "plans").iterdir() if p.name.startswith(".cp2-flashcp.")
                 and p.name.endswith(".tmp")]
    assert len(leftovers) == 1
    result = run(*args)
    assert result.exit_code == 0 and "removed 1 staging folder(s)" in result.stderr
    fresh = copy_tree(ws / "reference", tmp_path / "fresh")
    shutil.rmtree(fresh / "plans")
    assert run("plan", fresh, "--cp", 2, "--strategy", "flashcp", "--force").exit_code == 0
    assert tree(data / "plans") == tree(fresh / "plans")
