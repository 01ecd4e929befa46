import json

import numpy as np
import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from flashcp.data.dataset import Dataset
from flashcp.planner.plan_reader import PlanStore
from tests.audit_helpers import make_dataset, write_greedy_plan

# 32 tokens each
SEQUENCES = [[20, 9, 3], [7, 7, 7, 11], [30, 2], [12, 12, 8], [5, 5, 5, 5, 5, 7], [25, 4, 3]]


@pytest.fixture
def dataset(tmp_path):
    ds = make_dataset(tmp_path / "data", SEQUENCES, files=2)
    write_greedy_plan(ds, 2)
    return ds


def run(*args):
    return CliRunner().invoke(cli, ["audit", *map(str, args)])


def test_audit_prints_table_writes_json_and_plan(dataset, tmp_path):
    json_path = tmp_path / "audit.json"
    result = run(dataset.root, "--plan", "cp2-greedy", "--ilp", "--samples", 4, "--granularity", 2,
                 "--time-limit", 10, "--workers", 1, "--json", json_path, "--write-plan", "cp2-ilp")
    assert result.exit_code == 0, result.output
    for text in ("communication saving", "workload imbalance", "proven optimal", "ILP solver", "heuristic"):
        assert text in result.output
    report = json.loads(json_path.read_text())
    assert len(report["sequences"]) == 4 and report["summary"]["samples"] == 4
    rows = [s["row"] for s in report["sequences"]]
    assert rows == sorted(set(rows)) and all(0 <= r < len(SEQUENCES) for r in rows)
    for seq in report["sequences"]:
        assert seq["status"] == "OPTIMAL" and seq["valid_plan"] and seq["gap"] == 0
        # the weighted objective (imbalance + 1 * (1 - saving)) is never worse than the warm start's: the
        # heuristic plan rounded to blocks of 2 and repaired to the quotas
        ilp, start = seq["ilp"], seq["warm_start"]
        assert ilp["imbalance"] - ilp["comm_saving"] <= start["imbalance"] - start["comm_saving"] + 1e-9
        assert seq["objective"] == pytest.approx(ilp["imbalance"] + 1 - ilp["comm_saving"])

    written = PlanStore(Dataset(dataset.root), "cp2-ilp")
    assert written.meta["params"]["ilp_rows"] == rows and written.meta["strategy"] == "ilp"
    base = PlanStore(Dataset(dataset.root), "cp2-greedy")
    row = 0
    for i in range(len(dataset.files)):
        offsets, lens = dataset.read_doc_lens(i)
        for j, (new, old) in enumerate(zip(written.iter_plans(i), base.iter_plans(i))):
            new.plan.validate(lens[offsets[j]:offsets[j + 1]])
            assert new.plan.metrics().ag_comm_tokens == new.ag_comm_tokens
            if row in rows:
                by_row = {s["row"]: s for s in report["sequences"]}
                assert new.ag_comm_tokens == by_row[row]["ilp"]["ag_comm_tokens"]
            else:
                assert np.array_equal(new.plan.shard_len, old.plan.shard_len)
            row += 1

    verified = CliRunner().invoke(cli, ["verify", str(dataset.root)])  # the planner's own end-to-end check
    assert verified.exit_code == 0 and "cp2-ilp" in verified.output, verified.output

    again = run(dataset.root, "--plan", "cp2-greedy", "--ilp", "--samples", 1, "--granularity", 2,
                "--time-limit", 2, "--workers", 1, "--write-plan", "cp2-ilp")
    assert again.exit_code == 1 and "already exists" in again.output and "--force" in again.output


def test_lexicographic_and_match_imbalance_modes(dataset):
    for mode in ("--lexicographic", "--match-imbalance"):
        result = run(dataset.root, "--plan", "cp2-greedy", "--ilp", "--samples", 2, "--granularity", 1,
                     "--time-limit", 5, "--workers", 1, mode)
        assert result.exit_code == 0, result.output
        assert "communication saving" in result.output


def test_impossible_granularity_is_reported_not_crashed(tmp_path):
    # 1000 + 1000 + 48 tokens over 2 ranks (quota 1024) cannot be met with whole blocks of 1024
    ds = make_dataset(tmp_path / "data", [[1000, 1000, 48]] * 2)
    write_greedy_plan(ds, 2)
    json_path = tmp_path / "audit.json"
    result = run(ds.root, "--plan", "cp2-greedy", "--ilp", "--time-limit", 2, "--workers", 1,
                 "--json", json_path, "--write-plan", "cp2-ilp")
    assert result.exit_code == 0, result.output
    assert "impossible at granularity 1024" in result.output and "not a valid plan" in result.output
    assert "0 of 2 sequences" in result.output
    seqs = json.loads(json_path.read_text())["sequences"]
    assert all(s["exact_status"] == "INFEASIBLE" and not s["valid_plan"] and s["quota_slack"] == 1000
               for s in seqs)
    written = PlanStore(Dataset(ds.root), "cp2-ilp")
    assert written.meta["params"]["ilp_rows"] == []  # every row keeps the heuristic plan


@pytest.mark.parametrize("args,message", [
    (["--granularity", "100000000"], "larger than the context length"),
    (["--ilp", "--lexicographic", "--match-imbalance"], "exclude each other"),
    (["--ilp", "--write-plan", "cp2-greedy"], "overwrite the plan being audited"),
])
def test_bad_requests_exit_1_with_one_sentence(dataset, args, message):
    result = run(dataset.root, "--plan", "cp2-greedy", "--granularity", 4, "--time-limit", 1, "--workers", 1,
                 *args)
    assert result.exit_code == 1 and message in result.output


def test_missing_plan_exits_1(dataset):
    result = run(dataset.root, "--plan", "cp8-nothing", "--ilp")
    assert result.exit_code == 1 and "does not exist" in result.output


def test_sample_rows_is_seeded_distinct_and_bounded():
    from flashcp.errors import FlashcpError
    from flashcp.planner.ilp.audit import sample_rows

    a, b = sample_rows(100, 20, seed=3), sample_rows(100, 20, seed=3)
    assert np.array_equal(a, b) and np.unique(a).size == 20 and a.min() >= 0 and a.max() < 100
    assert not np.array_equal(a, sample_rows(100, 20, seed=4))
    assert np.array_equal(sample_rows(5, 20, seed=0), np.arange(5))  # more samples than rows: every row
    with pytest.raises(FlashcpError):
        sample_rows(5, 0, seed=0)
