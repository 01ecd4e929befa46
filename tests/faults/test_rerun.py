"""The fault suite, re-runs: a command whose output is already made from the same inputs says so and exits 0.

``pack`` already did; ``plan`` now does too: a plan made from the dataset as it is now, with the same strategy,
cp and options, intact, is kept (exit 0, nothing written); other options still need ``--force``, which
makes it again.
"""

from __future__ import annotations

import json
import shutil
import sysconfig

import pytest

from tests.faults.workspace import docs, one_sentence, pack_args, run, tree, unchanged, write_jsonl
from tests.readme import readme_main_job


def test_the_readme_plan_commands_run_twice(tmp_path, monkeypatch):
    """The README's main job's pack and plan commands, run twice in one folder: exit 0, nothing changed."""
    stdlib = sysconfig.get_path("stdlib")
    corpus = tmp_path / "corpus"
    shutil.copytree(f"{stdlib}/json", corpus / "json", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.chdir(tmp_path)
    steps = [step for step in readme_main_job() if step[0] in ("pack", "plan")]
    assert [s[0] for s in steps] == ["pack", "plan", "plan"]
    commands = []
    for step in steps:
        args = [str(corpus) if a == "$S" else a for a in step]
        if "--context-len" in args:
            args[args.index("--context-len") + 1] = "2048"
        commands.append(args)
    for args in commands:
        result = run(*args)
        assert result.exit_code == 0, result.output
    before = tree(tmp_path)
    for args in commands:
        result = run(*args)
        assert result.exit_code == 0, result.output
        if args[0] == "plan":
            assert "is up to date" in result.stderr and "nothing to do" in result.stderr
    assert tree(tmp_path) == before


@pytest.fixture
def ws(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", docs(30))
    assert run(*pack_args(tmp_path / "in.jsonl", tmp_path / "data")).exit_code == 0
    assert run("plan", tmp_path / "data", "--cp", 2, "--strategy", "flashcp", "--compare", 4).exit_code == 0
    return tmp_path


def test_same_options_up_to_date_other_options_refused_force_remakes(ws):
    plan = ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--compare", 4]
    before = tree(ws)
    result = run(*plan, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["up_to_date"] is True
    assert tree(ws) == before
    for extra, needle in ((["--target-imbalance", 1.2], "--target-imbalance 1.05 there, 1.2 now"),
                          (["--compare", 0], "--compare 4 there, 0 now")):
        unchanged(ws, [*plan[:-2], *extra] if extra[0] == "--compare" else [*plan, *extra], needle,
                  "pass --force")
    result = run(*plan, "--target-imbalance", 1.2, "--force")
    assert result.exit_code == 0 and "wrote" in result.stderr
    assert tree(ws) != before


@pytest.mark.parametrize("damage", ["plan file edited", "stale"])
def test_a_damaged_or_stale_plan_is_not_up_to_date(ws, damage):
    plan = ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--compare", 4]
    if damage == "plan file edited":  # same size and footer, other bytes
        path = ws / "data" / "plans" / "cp2-flashcp" / "part-00000.parquet"
        raw = bytearray(path.read_bytes())
        raw[4] ^= 0xFF
        path.write_bytes(bytes(raw))
        needle = "does not match plan.json"
    else:  # plan.json records other data files than the manifest lists
        path = ws / "data" / "plans" / "cp2-flashcp" / "plan.json"
        meta = json.loads(path.read_text())
        meta["data_files"][0]["sha256"] = "0" * 64
        path.write_text(json.dumps(meta))
        needle = "made from other data files"
    unchanged(ws, plan, needle, "pass --force")
    assert run(*plan, "--force").exit_code == 0
    result = run(*plan)
    one_sentence(result, "up to date", code=0)
