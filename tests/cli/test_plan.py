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


def _mha_config(folder):
    """A GPT-2 config of the shape plans were priced for before they recorded a model: one layer of H = H_kv =
    32, D = 128 and a plain MLP of 4 x 4096 (``AttentionShape()``'s ``hidden_mult`` 4), written by transformers."""
    from transformers import GPT2Config

    GPT2Config(n_embd=4096, n_head=32, n_layer=1, n_inner=16384, vocab_size=1000).to_json_file(
        folder / "config.json")
    return folder


def test_plan_model_builtin(dataset, tmp_path):
    from flashcp.costmodel.models import BUILTIN_MODELS

    root = fresh_copy(dataset, tmp_path)
    result = run("plan", root, "--cp", 2, "--model", "Qwen3-8B", "--compare", 4)
    assert result.exit_code == 0, result.output
    assert "priced for qwen3-8b: 36 layers (36 full), 32 heads / 8 K/V x 128" in result.output
    assert "36 layer(s) of H=32, H_kv=8, D=128" in result.output and "layer kinds" not in result.output
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["model"] == BUILTIN_MODELS["qwen3-8b"].as_dict() and meta["model"]["name"] == "qwen3-8b"
    assert {key: meta["params"][key] for key in ("num_heads", "num_kv_heads", "head_dim", "layers")} == \
        {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "layers": 36}
    assert meta["summary"]["compare"]["model"] == {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "layers": 36}
    assert run("verify", root).exit_code == 0  # every stored seq_cost is the model's price


def test_plan_model_default_and_windowed(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    result = run("plan", root, "--cp", 2, "--strategy", "flashcp", "--compare", 2)
    assert result.exit_code == 0, result.output
    meta = json.loads((root / "plans" / "cp2-flashcp" / "plan.json").read_text())
    assert meta["model"]["name"] == "llama-3-8b" and meta["params"] == {"target_imbalance": 1.05}
    assert meta["summary"]["compare"]["model"] == {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "layers": 32}
    result = run("plan", root, "--cp", 2, "--strategy", "flashcp", "--model", "gemma-3-12b", "--name", "gemma")
    assert result.exit_code == 0, result.output
    assert "layer kinds: priced by kind (40 window 1024, 8 full)" in result.output
    meta = json.loads((root / "plans" / "gemma" / "plan.json").read_text())
    assert meta["summary"]["compare"]["model"]["layer_kinds"] == [["window", 1024, 40], ["full", 0, 8]]


def test_plan_model_from_transformers_config(dataset, tmp_path):
    from transformers import LlamaConfig

    from flashcp.costmodel.models import model_from_config
    from flashcp.costmodel.objective import sequence_flops
    from flashcp.data.dataset import Dataset
    from flashcp.planner.plan_reader import PlanStore

    folder = tmp_path / "small-llama"
    folder.mkdir()
    LlamaConfig(num_key_value_heads=2, num_attention_heads=8, hidden_size=512, intermediate_size=1376,
                num_hidden_layers=3, vocab_size=1000).to_json_file(folder / "config.json")
    root = fresh_copy(dataset, tmp_path)
    for model in (folder, folder / "config.json"):  # a folder holding the file, or the file
        result = run("plan", root, "--cp", 2, "--model", model, "--compare", 2, "--force")
        assert result.exit_code == 0, result.output
        assert "priced for small-llama: 3 layers (3 full), 8 heads / 2 K/V x 64, hidden 512, MLP 1376" in result.output
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    spec = model_from_config(folder)
    assert meta["model"] == spec.as_dict()
    assert {key: meta["params"][key] for key in ("num_heads", "num_kv_heads", "head_dim", "layers")} == \
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "layers": 3}
    dataset_now = Dataset(root)
    store = PlanStore(dataset_now, "cp2-flashcp2")
    assert store.model == spec and store.cost_shape == spec.attention_shape()
    expected = sequence_flops(*dataset_now.read_doc_lens(0), spec.attention_shape())
    assert store.seq_costs(0).tolist() == pytest.approx(expected.tolist(), rel=1e-12)


def test_plan_model_hybrid_is_priced_with_its_recurrent_layers(dataset, tmp_path):
    from transformers import Qwen3NextConfig

    from flashcp.costmodel.models import model_from_config
    from flashcp.data.dataset import Dataset
    from flashcp.planner.plan_reader import PlanStore

    folder = tmp_path / "small-qwen3-next"
    folder.mkdir()
    Qwen3NextConfig(num_hidden_layers=4).to_json_file(folder / "config.json")
    root = fresh_copy(dataset, tmp_path)
    result = run("plan", root, "--cp", 2, "--model", folder, "--compare", 2)
    assert result.exit_code == 0, result.output
    assert "priced for small-qwen3-next: 4 layers (1 full, 3 recurrent gdn)" in result.output
    assert "D=256 and 3 recurrent gdn layer(s))" in " ".join(result.output.split())  # the step ms legend
    spec = model_from_config(folder)
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["model"] == json.loads(json.dumps(spec.as_dict())) and meta["model"]["recurrent"]["num_layers"] == 3
    assert meta["summary"]["compare"]["model"]["recurrent"] == meta["model"]["recurrent"]
    store = PlanStore(Dataset(root), "cp2-flashcp2")
    assert store.model == spec and store.cost_shape.recurrent == spec.recurrent
    assert run("verify", root).exit_code == 0


def test_rerun_with_another_model(dataset, tmp_path):
    from tests.faults.workspace import tree

    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2, "--compare", 0).exit_code == 0
    result = run("plan", root, "--cp", 2, "--compare", 0, "--model", "llama-3-8b")
    assert result.exit_code == 0 and "is up to date" in result.output
    before = tree(root)
    result = run("plan", root, "--cp", 2, "--compare", 0, "--model", "mistral-7b-v0.1")
    assert result.exit_code == 1 and "--model llama-3-8b there, mistral-7b-v0.1 now" in result.output
    assert tree(root) == before
    result = run("plan", root, "--cp", 2, "--compare", 0, "--model", "mistral-7b-v0.1", "--force")
    assert result.exit_code == 0, result.output
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["model"]["name"] == "mistral-7b-v0.1"


@pytest.mark.parametrize("model,message", [
    ("llama-5", "unknown model 'llama-5': name a built-in model (llama-3-8b,"),
    ("", "unknown model ''"),
    ("latent", "layer 0 is multi-head latent attention (kv_lora_rank=512), which flashcp cannot price"),
    ("broken", "cannot read"),
])
def test_plan_bad_model(dataset, tmp_path, model, message):
    from tests.faults.workspace import tree

    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2, "--strategy", "llama3", "--compare", 0).exit_code == 0
    if model == "latent":
        model = tmp_path / "latent.json"
        model.write_text(json.dumps({"model_type": "deepseek_v3", "num_attention_heads": 16, "hidden_size": 2048,
                                     "num_hidden_layers": 4, "vocab_size": 1000, "intermediate_size": 4096,
                                     "kv_lora_rank": 512}))
    elif model == "broken":
        model = tmp_path / "config.json"
        model.write_text("{not json")
    before = tree(root)
    for args in ([], ["--force"]):
        result = run("plan", root, "--cp", 2, "--model", model, *args)
        assert result.exit_code == 1, result.output
        assert message in result.output and result.output.count("error:") == 1
        assert tree(root) == before, "nothing written"


def test_show_and_ls_name_the_model(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2, "--strategy", "flashcp", "--compare", 0, "--model", "qwen3-8b").exit_code == 0
    assert run("plan", root, "--cp", 2, "--strategy", "flashcp", "--compare", 0, "--name", "old",
               "--model", _mha_config(tmp_path)).exit_code == 0
    meta_path = root / "plans" / "old" / "plan.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]  # as plan.json was written before it recorded the model
    meta_path.write_text(json.dumps(meta))
    result = run("show", root, "--plan", "cp2-flashcp", "--seq", 1)
    assert result.exit_code == 0, result.output
    assert "model: qwen3-8b: 36 layers (36 full), 32 heads / 8 K/V x 128" in result.output
    shown = json.loads(run("show", root, "--plan", "cp2-flashcp", "--seq", 1, "--json").stdout)
    assert shown["model"]["name"] == "qwen3-8b" and shown["model"]["num_kv_heads"] == 8
    result = run("show", root, "--plan", "old", "--seq", 1)
    assert result.exit_code == 0, result.output
    assert "model: no model recorded (made before plans recorded one): priced for H=32, H_kv=32, D=128, 1 layer(s)" \
        in result.output
    result = run("ls", root)
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.startswith(("cp2-", "old"))}
    assert "model qwen3-8b" in lines["cp2-flashcp"] and "no model recorded" in lines["old"]
    listing = json.loads(run("ls", root, "--json").stdout)
    models = {p["name"]: p["model"] for p in listing["plans"]}
    assert models == {"cp2-flashcp": "qwen3-8b", "old": None}
