"""The fault suite, files a user names for flashcp to write: --ckpt, --json FILE, --plot FILE, --profile-out.

Every refusal asserts the exit code, exactly one line on stderr, no traceback, and that the whole temporary
tree (dataset, the user's files, bystanders) is byte-identical afterwards; the accepted cases check that
flashcp's own output of the same kind is replaced. The multi-rank case (a DCP folder missing a shard refused
alike on every rank) rides on the gloo ranks ``tests/train/test_parallel.py`` already spawns.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os

import pytest
import torch

from flashcp.train.launch import free_port
from tests.faults.workspace import (
    ROOT,
    ReadOnly,
    packed_template,
    run,
    tree,
    unchanged,
    workspace,
)

TINY = ["--steps", "1", "--prefetch", "0", "--dim", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "16",
        "--layers", "1"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A packed dataset (byte tokenizer, 64-token sequences) with a cp1 and a cp2 plan."""
    return packed_template(tmp_path_factory.mktemp("outputs"), 12, [(1, "llama3"), (2, "llama3")])


@pytest.fixture
def ws(template, tmp_path):
    return workspace(template, tmp_path, {"notes.txt": "my notes", "afolder/mine.txt": "mine"})


# ---- bench --json / --plot / --profile-out and audit --json ----

def _bench(ws, *extra):
    return ["bench", ws / "data", "--quick", "--scenario", "quality,latency", "--cp", 2, "--heads", 4,
            "--strategies", "llama3", *extra]


@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize("target", ["notes.txt", "afolder", "data/manifest.json", "data/new.json", "data", "link"])
def test_bench_outputs_refuse_what_flashcp_did_not_write(ws, option, target):
    if target == "link":
        (ws / "link").symlink_to(ws / "notes.txt")
    needle = {"notes.txt": "flashcp replaces only its own files", "afolder": "is a folder",
              "link": "is a symlink", "data": "is the dataset"}.get(target, "lies inside the dataset")
    unchanged(ws, _bench(ws, option, ws / target), option, needle)


def test_bench_replaces_its_own_report_and_plot(ws):
    from flashcp.bench.plots import BENCH_PLOT
    from flashcp.bench.suite import BENCH_REPORT

    report, plot = ws / "out" / "bench.json", ws / "out" / "bench.png"
    for _ in range(2):  # the second run finds flashcp's own files there and replaces them
        result = run(*_bench(ws, "--json", report, "--plot", plot))
        assert result.exit_code == 0, result.output
        assert BENCH_REPORT.recognise(report) and BENCH_PLOT.recognise(plot)
        assert json.loads(report.read_text())["format"] == "flashcp-bench"
    assert not BENCH_PLOT.recognise(ROOT / "docs" / "bench-projected.png")  # any other PNG is not ours
    assert sorted(p.name for p in (ws / "out").iterdir()) == ["bench.json", "bench.png"]


def test_profile_out_is_checked_before_calibrating(ws):
    unchanged(ws, ["bench", "--calibrate", "--device", "cpu", "--profile-out", ws / "notes.txt"],
              "--profile-out", "is not a flashcp hardware profile")
    unchanged(ws, ["bench", "--calibrate", "--device", "cpu", "--profile-out", ws / "data" / "p.json"],
              "lies inside the dataset")
    from flashcp.bench.calibrate import save_profile
    from flashcp.costmodel.profile import load_profile

    save_profile(load_profile(), ws / "mine.json")  # flashcp's own profile: accepted, then no GPU to measure
    unchanged(ws, ["bench", "--calibrate", "--device", "cpu", "--profile-out", ws / "mine.json"],
              "is not an available CUDA device")


def test_audit_json(ws):
    audit = ["audit", ws / "data", "--plan", "cp2-llama3", "--samples", 1, "--time-limit", 1, "--granularity", 16]
    unchanged(ws, [*audit, "--json", ws / "notes.txt"], "is not a flashcp audit report")
    unchanged(ws, [*audit, "--json", ws / "data" / "plans" / "audit.json"], "lies inside the dataset")
    for _ in range(2):
        result = run(*audit, "--json", ws / "audit.json")
        assert result.exit_code == 0, result.output
    assert json.loads((ws / "audit.json").read_text())["format"] == "flashcp-audit"


def test_bench_scripts_check_json_before_running(ws):
    import subprocess
    import sys

    before = tree(ws)
    result = subprocess.run([sys.executable, ROOT / "scripts" / "pack_throughput.py", "--json", ws / "notes.txt"],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == 1 and tree(ws) == before
    assert result.stderr.count("\n") == 1 and "is not a scripts/pack_throughput.py report" in result.stderr


# ---- --ckpt ----

def _script():
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "examples" / "train_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture
def one_rank(monkeypatch):
    """A one-rank gloo group set up by the script itself (what torchrun's environment makes it do)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def train(ws, capsys, *args, plan: str = "cp1-llama3") -> tuple[int, str]:
    code = _script().main([str(ws / "data"), "--plan", plan, *TINY, *map(str, args)])
    return code, capsys.readouterr().err


def refused(ws, capsys, *args, needle: str) -> None:
    before = tree(ws)
    code, err = train(ws, capsys, *args)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err and "step 1/1" not in err, err  # refused before training
    assert tree(ws) == before


@pytest.mark.parametrize("target, needle", [
    ("notes.txt", "is not a flashcp checkpoint"), ("afolder", "is a folder"),
    ("data/manifest.json", "lies inside the dataset"), ("data/ck.pt", "lies inside the dataset"),
])
def test_ckpt_file_refused_before_training(ws, capsys, target, needle):
    refused(ws, capsys, "--ckpt", ws / target, needle=needle)


def test_ckpt_file_replaces_its_own_and_survives_a_failed_save(ws, capsys, monkeypatch):
    ck = ws / "ck.pt"
    for _ in range(2):
        code, err = train(ws, capsys, "--ckpt", ck)
        assert code == 0 and f"saved {ck}" in err, err
    saved = ck.read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    refused_late = tree(ws)
    code, err = train(ws, capsys, "--ckpt", ck)
    assert code == 1 and err.strip().splitlines()[-1] == f"error: cannot write checkpoint {ck}: No space left on device"
    assert ck.read_bytes() == saved and tree(ws) == refused_late
    monkeypatch.undo()
    with monkeypatch.context() as m:
        ReadOnly(m, ws)
        code, err = train(ws, capsys, "--ckpt", ck)
    assert code == 1 and "Permission denied" in err.strip().splitlines()[-1] and ck.read_bytes() == saved


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", ["user folder", "a file", "dataset", "staging", "old"])
def test_sharded_ckpt_refused_before_training(ws, capsys, one_rank, case):
    target = {"user folder": ws / "afolder", "a file": ws / "notes.txt", "dataset": ws / "data"}.get(case,
                                                                                                  ws / "ck")
    if case in ("staging", "old"):
        (ws / f".ck.{case}").mkdir()
        (ws / f".ck.{case}" / "mine.txt").write_text("mine")
    needle = {"user folder": "is not a flashcp sharded checkpoint", "a file": "is not a folder",
              "dataset": "is the dataset"}.get(case, "flashcp did not make it")
    refused(ws, capsys, "--sharding", "fsdp", "--ckpt", target, needle=needle)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("damage", [".metadata", "__0_0.distcp"])
def test_sharded_resume_with_a_missing_file(ws, capsys, one_rank, monkeypatch, damage):
    code, err = train(ws, capsys, "--sharding", "fsdp", "--ckpt", ws / "ck")
    assert code == 0, err
    assert sorted(p.name for p in ws.iterdir() if p.name.startswith(".ck")) == []  # no staging left
    (ws / "ck" / damage).unlink()
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    refused(ws, capsys, "--sharding", "fsdp", "--ckpt", ws / "ck", "--resume", needle="is incomplete: its "
            + (".metadata file" if damage == ".metadata" else f"shard {damage}") + " is missing")


def test_option_values_are_one_sentence(ws, capsys):
    refused(ws, capsys, "--vocab", 0, needle="vocab_size must be at least 1, got 0")
    refused(ws, capsys, "--heads", 0, needle="num_heads must be at least 1, got 0")


def test_a_plan_staging_name_holding_other_files_is_left_alone(ws):
    leftover = ws / "data" / "plans" / ".cp2-llama3.4242-0123abcd.tmp"
    leftover.mkdir()
    (leftover / "notes.txt").write_text("mine")
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "llama3", "--force")
    assert result.exit_code == 0 and "left plans/.cp2-llama3.4242-0123abcd.tmp alone" in result.stderr
    assert (leftover / "notes.txt").read_text() == "mine"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_marked_staging_folder_of_a_killed_save_is_removed(ws, capsys, one_rank):
    from flashcp.outputs import make_marked_dir

    staging = make_marked_dir(ws / ".ck.staging", "staging folder of checkpoint ck")  # as a killed save left it
    (staging / "__0_0.distcp").write_bytes(b"half")
    code, err = train(ws, capsys, "--sharding", "fsdp", "--ckpt", ws / "ck")
    assert code == 0 and not staging.exists() and (ws / "ck" / "flashcp.json").is_file(), err
