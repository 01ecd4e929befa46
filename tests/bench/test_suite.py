"""``flashcp bench`` scenarios beyond the default run, and scripts/snapshot.py, at toy sizes.

No timing is asserted; the numbers checked are the ones the cost model fixes (the ring's and the full
all-gather's K/V share) or that must agree between two computations of one run.
"""

from pathlib import Path

import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from tests.bench import bench_script as _script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, words", [
    (["--strategies", "nosuch"], "unknown strategy 'nosuch'"),
    (["--strategies", "flashcp2:effort"], "expected key=value"),
    (["--strategies", "llama3@1.1"], "takes no target imbalance"),
    (["--runtime-cases", "ring/warp"], "runtime case 'ring/warp'"),
    (["--e2e-seqs", "2", "--e2e-strategies", "nosuch"], "unknown strategy 'nosuch'"),
])
def test_scenario_refusals(args, words):
    result = CliRunner().invoke(cli, ["bench", "--quick", "--seqs", "1", "--context-len", "4096", *args])
    assert result.exit_code == 1, result.output
    assert words in result.output
    assert "Traceback" not in result.output


def test_snapshot_refuses_a_users_file_before_any_work(tmp_path):
    import subprocess
    import sys

    from tests.faults.workspace import tree

    out = tmp_path / "notes.json"
    out.write_text('{"mine": true}\n')
    before = tree(tmp_path)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "snapshot.py"), str(out), str(tmp_path / "work")],
                            capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "notes.json" in result.stderr
    assert tree(tmp_path) == before and not (tmp_path / "work").exists()


def test_snapshot_reuses_its_workdir_only_for_the_same_code(tmp_path, monkeypatch):
    snapshot = _script("snapshot")
    work = tmp_path / "work"
    assert snapshot.prepare_workdir(work, "code-a") is False  # new: made, marked, nothing to reuse
    for name in ("d-wlb/plans/p4-0", "tok"):
        (work / name).mkdir(parents=True)
    (work / "bench.json").write_text("{}")
    (work / "mine.txt").write_text("a user's file")
    assert snapshot.prepare_workdir(work, "code-a") is True  # the same code: everything kept
    assert (work / "d-wlb" / "plans" / "p4-0").is_dir() and (work / "bench.json").exists()
    assert snapshot.prepare_workdir(work, "code-b") is False  # other code: what the script made is rebuilt
    assert sorted(p.name for p in work.iterdir()) == [".flashcp-made", "mine.txt", snapshot.STAMP]
    assert snapshot.prepare_workdir(work, "code-b") is True

    package = tmp_path / "pkg"  # the code version follows every source file of the package imported
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "planner.py").write_text("RULE = 1\n")
    monkeypatch.setattr(snapshot.flashcp, "__file__", str(package / "__init__.py"))
    before = snapshot.code_version()
    assert snapshot.code_version() == before
    (package / "planner.py").write_text("RULE = 2\n")
    assert snapshot.code_version() != before


def test_snapshot_refuses_a_workdir_it_did_not_make(tmp_path):
    import subprocess
    import sys

    from tests.faults.workspace import tree

    work = tmp_path / "work"  # plans of unknown origin: reusing them would compare a run with itself
    (work / "d-wlb" / "plans").mkdir(parents=True)
    (work / "bench.json").write_text('{"format": "flashcp-bench"}\n')
    before = tree(tmp_path)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "snapshot.py"), str(tmp_path / "out.json"),
                             str(work)], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "was not made by scripts/snapshot.py" in result.stderr and "Traceback" not in result.stderr
    assert tree(tmp_path) == before


def test_snapshot_skips_dcp_up_front_without_mtkahypar(monkeypatch):
    import importlib.util

    snapshot = _script("snapshot")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mtkahypar" else real(name, *a))
    strategies, notes = snapshot.strategies_here()
    assert "dcp" not in strategies and "flashcp2" in strategies
    assert notes == ["dcp: skipped, mtkahypar is not installed (pip install -e '.[hypergraph]' to include it)"]
