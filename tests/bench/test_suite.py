"""``flashcp bench`` scenarios beyond the default run, and bench/'s wrapper scripts, at toy sizes.

No timing is asserted; the numbers checked are the ones the cost model fixes (the ring's and the full
all-gather's K/V share) or that must agree between two computations of one run.
"""

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from tests import naive

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args):
    result = CliRunner().invoke(cli, ["bench", *args])
    assert result.exit_code == 0, result.output
    return result


def test_quality_strategy_specs(tmp_path):
    out = tmp_path / "q.json"
    result = _bench("--scenario", "quality", "--dist", "wlb", "--cp", "4", "--seqs", "3", "--context-len", "8192",
                    "--strategies", "flashcp+,flashcp+@1.05,magi:chunk_size=1024,flashcp2:effort=0;token_slack=0.05,"
                    "flashcp2", "--price-tokens", "--json", str(out))
    rows = json.loads(out.read_text())["quality"]["rows"]
    assert [r["strategy"] for r in rows] == ["flashcp+", "flashcp+@1.05", "magi:chunk_size=1024",
                                             "flashcp2:effort=0;token_slack=0.05", "flashcp2"]
    assert rows[1]["params"]["target_imbalance"] == 1.05 and rows[2]["params"]["chunk_size"] == 1024
    assert rows[3]["params"]["effort"] == 0 and rows[3]["params"]["token_slack"] == 0.05
    for r in rows:
        assert r["received_pct"] == pytest.approx(100 * (1 - r["a2a_saving_mean"]))
        assert r["step_ms"] == pytest.approx(sum(r["step_ms_all"]) / 3)
        assert r["shards_per_rank"] == pytest.approx(r["shards_mean"] / 4)
    # flashcp2's targets: its imbalance, its step time against the 4 other specs of its row, its receive
    # against the plain peers among them (flashcp+ only: the others carry parameters)
    assert "flashcp2:effort=0;token_slack=0.05" in result.output
    targets = json.loads(out.read_text())["quality"]["targets"]
    assert len(targets) == 1 + 4 + 1
    assert sum(f"target: wlb cp4 {t}" in result.output for t in ("flashcp2 max", "step", "receive")) == 3


def test_ring_cost_scenario(tmp_path):
    out = tmp_path / "r.json"
    result = _bench("--scenario", "ring-cost", "--dist", "wlb,pile", "--cp", "4", "--seqs", "2", "--context-len",
                    "512", "--json", str(out))
    assert "Ring baselines by the cost model" in result.output
    rows = json.loads(out.read_text())["ring-cost"]["rows"]
    for source in ("wlb", "pile~lognormal"):
        mine = {(r["layout"], r["comm"]): r for r in rows if r["source"] == source}
        assert {("llama3", "full"), ("perdoc", "full"), ("ring", "ring"), ("perdoc", "ring")} <= set(mine)
        for key in (("llama3", "full"), ("perdoc", "full"), ("ring", "ring"), ("perdoc", "ring")):
            # every rank receives 3/4 of the sequence's K/V with the ring and with the full all-gather
            assert mine[key]["recv_over_c"] == pytest.approx(0.75)
        assert mine[("perdoc", "ring")]["calls"] == 4.0  # one call per ring step, every step has work


def test_speed_and_end_to_end(tmp_path):
    out = tmp_path / "s.json"
    result = _bench("--scenario", "speed", "--dist", "wlb", "--cp", "2", "--context-len", "2048", "--speed-seqs",
                    "4", "--strategies", "llama3,flashcp+", "--e2e-seqs", "3", "--e2e-strategies", "flashcp",
                    "--workers", "1", "--json", str(out))
    results = json.loads(out.read_text())
    rows = results["speed"]["rows"]
    assert [r["strategy"] for r in rows] == ["llama3", "flashcp+"]
    assert all(r["num_seqs"] == 4 and r["batch_seqs_per_cpu_s"] > 0 for r in rows)
    # the plain-Python references are bench/plan_speed.py's (tests/naive.py), not the package's
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


def test_runtime_cases_ring_ratios(tmp_path):
    out = tmp_path / "rt.json"
    result = _bench("--scenario", "runtime", "--dist", "wlb", "--runtime-cases", "llama3/full,ring/full,ring/ring",
                    "--runtime-context-len", "128", "--runtime-cp", "2", "--runtime-seqs", "1", "--runtime-reps", "1",
                    "--runtime-heads", "2", "--runtime-kv-heads", "1", "--runtime-head-dim", "8", "--json", str(out))
    runtime = json.loads(out.read_text())["runtime"]
    assert [r["case"] for r in runtime["rows"]] == ["llama3/full", "ring/full", "ring/ring"]
    assert (runtime["num_heads"], runtime["num_kv_heads"], runtime["head_dim"]) == (2, 1, 8)
    by = {r["case"]: r["step_ms"] for r in runtime["rows"]}
    assert runtime["ring"]["ring_over_full"] == {"ring": pytest.approx(by["ring/ring"] / by["ring/full"])}
    assert runtime["ring"]["system_over"]["Ring-Attn"] == {"Llama3 CP": pytest.approx(by["ring/ring"] /
                                                                                      by["llama3/full"])}
    assert "step time, ring / full comm on the same layout: ring" in result.output


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


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wrappers_spell_bench_commands(tmp_path):
    quality = _script("plan_quality").bench_args(["--num-seqs", "2", "--cp", "8,16", "--dists", "wlb",
                                                  "--strategies", "flashcp2:effort=4", "--price-tokens",
                                                  "--json", "q.json"])
    assert quality == ["bench", "--scenario", "quality", "--dist", "wlb", "--cp", "8,16", "--strategies",
                       "flashcp2:effort=4", "--seqs", "2", "--context-len", "131072", "--seed", "0", "--json",
                       "q.json", "--price-tokens"]
    # and the CLI takes what they spell
    _bench(*quality[1:-3], "--context-len", "4096", "--json", str(tmp_path / "q.json"))
