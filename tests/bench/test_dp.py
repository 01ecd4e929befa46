"""The DP step efficiency scenario (flashcp.bench.dp): prices in the loader's stream order, the balanced order
the loader trains, and the command's table."""

import json

import numpy as np
from click.testing import CliRunner

from flashcp.bench.dp import dp_scenario, stream_costs
from flashcp.bench.sequences import open_source
from flashcp.cli import cli
from flashcp.costmodel.models import resolve_model
from flashcp.costmodel.shape import AttentionShape
from flashcp.data.dataset import Dataset
from flashcp.runtime.loader import stream_rows
from tests.naive import naive_sequence_flops


def test_the_default_price_is_llama3_8b_with_its_gated_mlp():
    shape = resolve_model("llama-3-8b").attention_shape()
    d = 4096
    assert shape.token_flops() == 3 * (4 * d * d + 4 * d * 1024 + 6 * 14336 * d)  # three MLP matrices
    assert shape.layers == 32 and shape.num_kv_heads == 8


def test_stream_costs_follow_the_loaders_order_and_balance_never_loses(tmp_path):
    data = tmp_path / "d"
    result = CliRunner().invoke(cli, ["synth", str(data), "--dist", "wlb", "--num-seqs", "40", "--context-len",
                                      "4096", "--no-tokens", "--rows-per-file", "16", "--seed", "1"])
    assert result.exit_code == 0, result.output
    dataset = Dataset(data)
    rows = []
    for index in range(len(dataset.files)):
        offsets, lens = dataset.read_doc_lens(index)
        rows += [lens[offsets[i]:offsets[i + 1]].tolist() for i in range(offsets.size - 1)]
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=8, layers=2)
    expected = [naive_sequence_flops(rows[r], 4, 2, 8, 2) for r in stream_rows(data, seed=5)]
    got = stream_costs(open_source(str(data)), 30, 4096, 5, shape)
    assert np.allclose(got, expected[:30], rtol=1e-12, atol=0)
    model = resolve_model("llama-3-8b")
    report = dp_scenario([open_source(str(data)), open_source("prolong")], [2, 4, 8], 3, 40, 4096, 5, model)
    assert report["model"] == model.describe() and report["shape"] == model.attention_shape().as_dict()
    assert [(r["source"], r["dp"]) for r in report["rows"]] == [(s, dp) for s in ("d", "prolong") for dp in (2, 4, 8)]
    for r in report["rows"]:
        assert r["balanced_efficiency"] >= r["stream_efficiency"] - 1e-12 and r["cost_ratio"] > 1
        assert 0 < r["stream_efficiency"] <= 1 and r["balanced_efficiency"] <= 1
        assert r["speedup"] == r["balanced_efficiency"] / r["stream_efficiency"]


def test_the_command_prints_the_table(tmp_path):
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, ["bench", "--dist", "wlb", "--scenario", "dp", "--seqs", "64", "--context-len",
                                      "8192", "--dp", "4,16", "--balance-window", "4", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "DP step efficiency" in result.output and "speed-up" in result.output
    rows = json.loads(out.read_text())["dp"]["rows"]
    assert [r["dp"] for r in rows] == [4, 16] and all(r["window"] == 4 for r in rows)
    result = CliRunner().invoke(cli, ["bench", "--dist", "wlb", "--scenario", "dp", "--dp", "0"])
    assert result.exit_code != 0


def test_the_scenario_prices_the_model_named(tmp_path):
    """Gemma 3's five window-1,024 layers per global one flatten the spread a full-attention model balances."""
    costs = {}
    for model in ("llama-3-8b", "gemma-3-12b"):
        out = tmp_path / f"{model}.json"
        result = CliRunner().invoke(cli, ["bench", "--dist", "wlb", "--scenario", "dp", "--seqs", "64",
                                          "--context-len", "32768", "--dp", "8", "--model", model, "--json",
                                          str(out)])
        assert result.exit_code == 0, result.output
        assert model in result.output
        report = json.loads(out.read_text())["dp"]
        assert report["shape"] == resolve_model(model).attention_shape().as_dict()
        costs[model] = report["rows"][0]["cost_ratio"]
    assert 1 < costs["gemma-3-12b"] < costs["llama-3-8b"]
