"""``verify`` (flashcp.planner.verify): a clean dataset passes; a plan file that breaks a rule is named."""

import json

import numpy as np
import pyarrow.parquet as pq
from click.testing import CliRunner

from flashcp.cli import cli
from flashcp.planner.plan_writer import plan_table, write_plan_file
from flashcp.planner.verify import verify_dataset


def _dataset(tmp_path):
    data = tmp_path / "d"
    runner = CliRunner()
    for args in (["synth", str(data), "--dist", "wlb", "--num-seqs", "5", "--context-len", "4096", "--no-tokens"],
                 ["plan", str(data), "--cp", "4", "--strategy", "llama3", "--compare", "0"]):
        assert runner.invoke(cli, args).exit_code == 0
    return data


def test_a_clean_dataset_verifies(tmp_path):
    data = _dataset(tmp_path)
    for fast in (False, True):
        report = verify_dataset(data, fast=fast)
        assert report.ok, report.problems
        assert report.data_files == 1 and report.sequences == 5 and report.plans == {"cp4-llama3": 5}


def test_a_plan_row_with_a_moved_shard_is_named(tmp_path):
    """The file is rewritten with a consistent hash in plan.json: only the coverage check can find it."""
    data = _dataset(tmp_path)
    plan_dir = data / "plans" / "cp4-llama3"
    table = pq.read_table(plan_dir / "part-00000.parquet")
    flat = {name: np.array(table.column(name).combine_chunks().flatten()) for name in
            ("shard_doc", "shard_start", "shard_len", "shard_rank")}
    offsets = np.asarray(table.column("shard_rank").combine_chunks().offsets)
    flat["shard_start"][offsets[2]] += 1  # row 2's first shard starts one token late: a gap and an overlap
    bad = plan_table(offsets, flat["shard_doc"], flat["shard_start"], flat["shard_len"], flat["shard_rank"],
                     table.column("imbalance").to_numpy(), table.column("ag_comm_tokens").to_numpy(),
                     table.column("a2a_comm_tokens").to_numpy(), table.column("seq_cost").to_numpy())
    meta = json.loads((plan_dir / "plan.json").read_text())
    meta["plan_files"][0] = write_plan_file(plan_dir, 0, bad, 4)
    (plan_dir / "plan.json").write_text(json.dumps(meta))
    report = verify_dataset(data)
    assert not report.ok and len(report.problems) == 1
    assert "row 2" in report.problems[0] and "cp4-llama3" in report.problems[0], report.problems
