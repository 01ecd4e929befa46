"""``flashcp bench`` end to end at toy sizes (no timing asserts), and its refusals."""

import json

import pytest
from click.testing import CliRunner

from flashcp.cli import cli


def test_bench_quick_smoke(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = CliRunner().invoke(cli, [
        "bench", "--quick", "--dist", "wlb,pile", "--context-len", "16384", "--seqs", "2", "--cp", "2,4",
        "--heads", "8", "--runtime-context-len", "256", "--runtime-cp", "2", "--json", str(out_json),
        "--plot", str(out_png)])
    assert result.exit_code == 0, result.output
    for words in ("Plan quality", "Planner speed", "Runtime on CPU, MEASURED", "PROJECTED", "paper Figure 6",
                  "paper 1.38x", "paper 1.63x", "target: FlashCP faster than Llama3 CP",
                  # each long phase says what it does while it runs
                  "bench: quality: planning 2 sequence(s) of 16,384 tokens from each of wlb, pile",
                  "bench: runtime: cp_attention forward and backward of 6 case(s) on 2 gloo ranks",
                  # the CPU measurement says what it can and cannot show, and is no GPU target
                  "What this CPU measurement shows:", "What it cannot show: which strategy is fastest on GPUs",
                  "CPU check (not a GPU speed target): CPU-measured step time ranks the systems"):
        assert words in result.output, words
    assert "target: CPU-measured" not in result.output
    results = json.loads(out_json.read_text())
    assert {"quality", "speed", "runtime", "latency", "profile"} <= set(results)
    assert len(results["quality"]["rows"]) == 2 * 2 * len(results["strategies"])
    settings = results["latency"]["settings"]
    assert [(s["source"], s["cp"]) for s in settings] == [("wlb", 2), ("wlb", 4), ("pile", 2), ("pile", 4)]
    for setting in settings:
        assert setting["systems"]["Llama3 CP"]["speedup"] == 1.0
        assert all(r["kind"] == "projected" for r in setting["systems"].values())
    assert len(results["latency"]["sweep"]["points"]) == 5
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    (["--dist", "nosuch"], "unknown distribution 'nosuch'"),
    (["--scenario", "warp"], "unknown scenario 'warp'"),
    (["--profile", "{missing}.json"], "cannot be read"),
    (["--measured", "--device", "cpu"], "--measured needs a CUDA device"),
    (["--model", "llama-5"], "unknown model 'llama-5'"),
])
def test_bench_refusals(tmp_path, args, words):
    args = [a.replace("{missing}", str(tmp_path / "missing")) for a in args]
    result = CliRunner().invoke(cli, ["bench", "--quick", "--seqs", "1", "--context-len", "4096", *args])
    assert result.exit_code == 1, result.output
    assert words in result.output
