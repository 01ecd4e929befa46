"""``flashcp verify`` (flashcp.cli.verify): corrupt, stale and tampered files are named; unfinished plan
folders only warn."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from flashcp.fileio import parquet_fingerprint, sha256_file
from tests.cli import fresh_copy, run


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
