import json

import pytest

from flashcp.fileio import sha256_file
from tests.cli import fresh_copy, run


def test_plan_verify_show(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    for strategy in ("flashcp", "flashcp+"):
        result = run("plan", root, "--cp", 3, "--strategy", strategy)
        assert result.exit_code == 0, result.output
        assert strategy in result.output and "llama3" in result.output and "perdoc" in result.output
        assert (root / "plans" / f"cp3-{strategy}" / "plan.json").is_file()
    meta = json.loads((root / "plans" / "cp3-flashcp" / "plan.json").read_text())
    assert meta["params"] == {"target_imbalance": 1.05} and meta["summary"]["sequences"] == 24
    assert meta["summary"]["imbalance_max"] <= 1.05
    result = run("verify", root)
    assert result.exit_code == 0, result.output
    assert "ok: plan cp3-flashcp: 24 sequence plans" in result.output
    assert "ok: plan cp3-flashcp+" in result.output
    result = run("show", root, "--plan", "cp3-flashcp+", "--seq", 5)
    assert result.exit_code == 0, result.output
    assert "sequence 5" in result.output and "rank 2" in result.output and "receives" in result.output
    result = run("show", root, "--seq", 5)
    assert result.exit_code == 1 and "several plans" in result.output


def test_replan_needs_force(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2).exit_code == 0
    first = sha256_file(root / "plans" / "cp2-flashcp2" / "part-00000.parquet")
    result = run("plan", root, "--cp", 2, "--target-imbalance", 1.2)
    assert result.exit_code == 1 and "already exists" in result.output and "--force" in result.output
    assert "--target-imbalance 1.05 there, 1.2 now" in result.output
    assert sha256_file(root / "plans" / "cp2-flashcp2" / "part-00000.parquet") == first  # refused: untouched
    result = run("plan", root, "--cp", 2, "--force", "--target-imbalance", 1.2)
    assert result.exit_code == 0, result.output
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["params"]["target_imbalance"] == 1.2
    # the new plan replaced the old one whole: no staging folder left, plan.json names the file's bytes
    assert sorted(p.name for p in (root / "plans").iterdir()) == ["cp2-flashcp2"]
    assert meta["plan_files"][0]["sha256"] == sha256_file(root / "plans" / "cp2-flashcp2" / "part-00000.parquet")


@pytest.mark.parametrize("args,message", [
    (["--cp", 0], "cp must be at least 1"),
    (["--cp", 5000], "above the 4099 tokens per sequence"),
    (["--cp", 2, "--strategy", "zigzag"], "unknown strategy 'zigzag'"),
    (["--cp", 2, "--strategy", "llama3", "--target-imbalance", 1.1], "takes no target imbalance"),
    (["--cp", 2, "--target-imbalance", 0.9], "at least 1.0"),
    (["--cp", 2, "--workers", 0], "--workers must be at least 1"),
])
def test_plan_bad_input(dataset, tmp_path, args, message):
    root = fresh_copy(dataset, tmp_path)
    result = run("plan", root, *args)
    assert result.exit_code == 1
    assert message in result.output
    assert result.output.count("error:") == 1
    assert not (root / "plans").exists() or not any((root / "plans").iterdir()), "nothing half-written"


def test_missing_manifest_and_unknown_dist(tmp_path):
    (tmp_path / "empty").mkdir()
    for command in (["plan", tmp_path / "empty", "--cp", 2], ["verify", tmp_path / "empty"],
                    ["show", tmp_path / "empty"]):
        result = run(*command)
        assert result.exit_code == 1 and "has no manifest.json" in result.output
    result = run("synth", tmp_path / "x", "--dist", "zipf", "--num-seqs", 2, "--context-len", 64)
    assert result.exit_code == 1 and "unknown distribution 'zipf'" in result.output
    assert not (tmp_path / "x").exists()


def test_workers_give_identical_plans(tmp_path):
    root = tmp_path / "lean"
    result = run("synth", root, "--dist", "pile", "--num-seqs", 2100, "--context-len", 8192, "--no-tokens",
                 "--rows-per-file", 500)
    assert result.exit_code == 0, result.output
    assert "in 5 data file(s)" in result.output
    for workers in (1, 2):
        result = run("plan", root, "--cp", 8, "--strategy", "flashcp+", "--workers", workers, "--name",
                     f"w{workers}")
        assert result.exit_code == 0, result.output
    one, two = (json.loads((root / "plans" / f"w{w}" / "plan.json").read_text()) for w in (1, 2))
    assert [f["sha256"] for f in one["plan_files"]] == [f["sha256"] for f in two["plan_files"]]
    assert one["summary"] == two["summary"]
    assert run("verify", root).exit_code == 0
