"""The plan-quality scenario (flashcp.bench.quality): strategy specs with targets and parameters, at toy sizes."""


import json
from pathlib import Path

import pytest

from tests.bench import bench_run as _bench

ROOT = Path(__file__).resolve().parents[2]


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


def test_quality_names_and_prices_its_model(tmp_path):
    from flashcp.costmodel.models import BUILTIN_MODELS

    out = tmp_path / "q.json"
    result = _bench("--scenario", "quality", "--dist", "wlb", "--cp", "4", "--seqs", "2", "--context-len", "8192",
                    "--model", "qwen3-8b", "--strategies", "flashcp2,flashcp2:num_kv_heads=32,flashcp+",
                    "--json", str(out))
    quality = json.loads(out.read_text())["quality"]
    assert quality["model"] == BUILTIN_MODELS["qwen3-8b"].as_dict()
    assert "one layer of qwen3-8b (H=32, H_kv=8, D=128)" in " ".join(result.output.split())
    params = {r["strategy"]: r["params"] for r in quality["rows"]}
    assert params["flashcp2"]["num_kv_heads"] == 8 and params["flashcp2"]["layers"] == 36
    assert params["flashcp2:num_kv_heads=32"]["num_kv_heads"] == 32  # a spec's shape parameter overrides
    assert "num_kv_heads" not in params["flashcp+"]


def test_quality_prices_a_windowed_models_mean_layer(tmp_path):
    """gemma-3-12b's step ms is its mean layer (5 window-1024 layers per full one, each priced by its kind):
    below the same plans priced as if every layer were full."""
    from flashcp.costmodel.models import BUILTIN_MODELS

    rows = {}
    for name, config in (("gemma-3-12b", "gemma-3-12b"), ("all-full", tmp_path / "config.json")):
        if name == "all-full":  # gemma-3-12b's shape with every layer full
            spec = BUILTIN_MODELS["gemma-3-12b"]
            config.write_text(json.dumps({
                "model_type": "llama", "num_attention_heads": spec.num_heads, "num_key_value_heads":
                spec.num_kv_heads, "head_dim": spec.head_dim, "hidden_size": spec.hidden_size, "intermediate_size":
                spec.mlp_width, "vocab_size": spec.vocab_size, "num_hidden_layers": spec.num_layers}))
        out = tmp_path / f"{name}.json"
        result = _bench("--scenario", "quality", "--dist", "wlb", "--cp", "4", "--seqs", "2", "--context-len",
                        "8192", "--model", str(config), "--strategies", "flashcp+", "--json", str(out))
        assert result.exit_code == 0, result.output
        if name == "gemma-3-12b":
            assert "the mean layer (each layer kind priced on its own) of gemma-3-12b" in \
                " ".join(result.output.split())
        rows[name] = json.loads(out.read_text())["quality"]["rows"][0]
    assert rows["gemma-3-12b"]["imbalance_mean"] == rows["all-full"]["imbalance_mean"]  # the same plans
    assert rows["gemma-3-12b"]["step_ms"] < rows["all-full"]["step_ms"], (rows["gemma-3-12b"]["step_ms"],
                                                                        rows["all-full"]["step_ms"])
