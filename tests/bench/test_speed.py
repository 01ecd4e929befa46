"""Planner speed (flashcp.bench.speed): the scenario, end to end, and scripts/plan_speed.py with the Python
references."""


import json
from pathlib import Path

from tests import naive
from tests.bench import bench_run as _bench
from tests.bench import bench_script as _script

ROOT = Path(__file__).resolve().parents[2]


def test_speed_and_end_to_end(tmp_path):
    out = tmp_path / "s.json"
    result = _bench("--scenario", "speed", "--dist", "wlb", "--cp", "2", "--context-len", "2048", "--speed-seqs",
                    "4", "--strategies", "llama3,flashcp+", "--e2e-seqs", "3", "--e2e-strategies", "flashcp",
                    "--workers", "1", "--json", str(out))
    results = json.loads(out.read_text())
    rows = results["speed"]["rows"]
    assert [r["strategy"] for r in rows] == ["llama3", "flashcp+"]
    assert all(r["num_seqs"] == 4 and r["batch_seqs_per_cpu_s"] > 0 for r in rows)
    # the plain-Python references are scripts/plan_speed.py's (tests/naive.py), not the package's
    assert not [key for r in rows for key in r if key.startswith("python")] and "Python seq/s" not in result.output
    e2e = results["end_to_end"]
    assert [(p["strategy"], p["workers"]) for p in e2e["plans"]] == [("flashcp", 1)]
    assert e2e["verified_plans"] == 1
    assert "plan --cp 2 --strategy flashcp --workers 1" in result.output


def test_plan_speed_script_times_and_checks_the_references(tmp_path, capsys):
    out = tmp_path / "s.json"
    script = _script("plan_speed")
    assert script.main(["--dist", "wlb", "--cp", "2", "--context-len", "2048", "--num-seqs", "4", "--reference-seqs",
                        "2", "--strategies", "llama3,flashcp+,flashcp+@1.05", "--e2e-seqs", "0", "--json",
                        str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["format"] == "flashcp-plan-speed" and "end_to_end" not in results
    rows = results["speed"]["rows"]
    # a spec with parameters of its own has no reference
    assert [(r["strategy"], r["python_seqs"], r["python_matches"]) for r in rows] == [
        ("llama3", 2, True), ("flashcp+", 2, True), ("flashcp+@1.05", 0, None)]
    assert all(r["speedup"] > 0 for r in rows[:2])
    assert "Python seq/s" in capsys.readouterr().out
    assert script.naive_planner("flashcp+") is naive.naive_flashcp_plus
