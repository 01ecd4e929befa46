import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from flashcp.fileio import parquet_fingerprint, sha256_file


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli") / "data"
    result = run("synth", root, "--dist", "wlb", "--num-seqs", 24, "--context-len", 4099, "--seed", 3,
                 "--vocab-size", 1000)
    assert result.exit_code == 0, result.output
    assert "24 sequences x 4,099 tokens" in result.output
    return root


def fresh_copy(dataset, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(dataset, target)
    shutil.rmtree(target / "plans", ignore_errors=True)
    return target


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
    result = run("plan", root, "--cp", 2)
    assert result.exit_code == 1 and "already exists" in result.output and "--force" in result.output
    result = run("plan", root, "--cp", 2, "--force", "--target-imbalance", 1.2)
    assert result.exit_code == 0, result.output
    meta = json.loads((root / "plans" / "cp2-flashcp2" / "plan.json").read_text())
    assert meta["params"]["target_imbalance"] == 1.2
    assert sorted(p.name for p in (root / "plans").iterdir()) == ["cp2-flashcp2"]
    assert first  # the old plan was replaced only once the new one was complete


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


def test_corrupt_data_file(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    path = root / "data" / "part-00000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\0" * 64
    path.write_bytes(bytes(data))
    result = run("verify", root)
    assert result.exit_code == 1 and "does not match its sha256 in the manifest" in result.output
    path.write_bytes(b"not parquet at all")
    result = run("plan", root, "--cp", 2)
    assert result.exit_code == 1 and "was replaced or truncated" in result.output
    assert not (root / "plans" / "cp2-flashcp2").exists()


def test_stale_plan(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2).exit_code == 0
    # the data changes (re-written with other lengths) and its manifest follows: the plan is now stale
    other = tmp_path / "other"
    assert run("synth", other, "--dist", "prolong", "--num-seqs", 24, "--context-len", 4099).exit_code == 0
    shutil.copy(other / "data" / "part-00000.parquet", root / "data" / "part-00000.parquet")
    shutil.copy(other / "manifest.json", root / "manifest.json")
    for command in (["verify", root], ["show", root, "--plan", "cp2-flashcp2"]):
        result = run(*command)
        assert result.exit_code == 1 and "plan 'cp2-flashcp2' is stale" in result.output


def test_tampered_plan(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 4).exit_code == 0
    plan_dir = root / "plans" / "cp4-flashcp2"
    path = plan_dir / "part-00000.parquet"
    table = pq.read_table(path)
    imbalance = table.column("imbalance").to_pylist()
    imbalance[7] += 0.01
    table = table.set_column(table.schema.get_field_index("imbalance"), "imbalance", pa.array(imbalance))
    pq.write_table(table, path)
    result = run("verify", root)
    assert result.exit_code == 1 and "part-00000.parquet has" in result.output and "plan.json records" in \
        result.output
    meta = json.loads((plan_dir / "plan.json").read_text())
    meta["plan_files"][0]["sha256"] = sha256_file(path)
    meta["plan_files"][0]["bytes"], meta["plan_files"][0]["footer_sha256"] = parquet_fingerprint(path)
    (plan_dir / "plan.json").write_text(json.dumps(meta))
    result = run("verify", root)
    assert result.exit_code == 1 and "row 7: stored imbalance" in result.output
    shard_len = table.column("shard_len").to_pylist()
    shard_len[3][0] += 1
    shard_len[3][-1] -= 1
    table = table.set_column(table.schema.get_field_index("shard_len"), "shard_len",
                             pa.array(shard_len, pa.list_(pa.int32())))
    pq.write_table(table, path)
    meta["plan_files"][0]["sha256"] = sha256_file(path)
    meta["plan_files"][0]["bytes"], meta["plan_files"][0]["footer_sha256"] = parquet_fingerprint(path)
    (plan_dir / "plan.json").write_text(json.dumps(meta))
    result = run("verify", root)
    assert result.exit_code == 1 and "row 3: the plan" in result.output


def test_unfinished_plan_folder_is_only_a_warning(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    (root / "plans" / "cp2-half").mkdir(parents=True)
    result = run("verify", root)
    assert result.exit_code == 0 and "no plan.json" in result.output and "no plans to check" in result.output
    result = run("show", root, "--plan", "cp2-half")
    assert result.exit_code == 1 and "plan 'cp2-half' does not exist" in result.output


def test_show_out_of_range(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2, "--strategy", "perdoc").exit_code == 0
    result = run("show", root, "--seq", 24)
    assert result.exit_code == 1 and "sequence 24 is out of range" in result.output


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
