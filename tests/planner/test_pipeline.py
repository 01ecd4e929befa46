"""``flashcp plan`` streams row groups (bounded memory), compares with the baselines on ``--compare`` sequences,
and prints a summary that compares like with like; ``ls`` lists plans by cp, then strategy."""

from __future__ import annotations

import gc
import json
import weakref

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from flashcp.costmodel.models import BUILTIN_MODELS, DEFAULT_MODEL
from flashcp.costmodel.objective import plan_step_seconds
from flashcp.data.dataset import Dataset
from flashcp.planner import compare, pipeline, plan_writer
from flashcp.planner.compare import BASELINES
from flashcp.planner.params import objective_model
from flashcp.planner.pipeline import read_row_group_lens
from flashcp.planner.planning import plan_rows, plan_sequence, strategy_metrics

DEFAULT_SHAPE = BUILTIN_MODELS[DEFAULT_MODEL].attention_shape()
"""What ``flashcp plan`` prices for unless told otherwise (``--model``)."""
GROUP_ROWS = 1024
"""Rows per row group of a lengths-only ``synth`` dataset."""


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def synth(root, num_seqs, context_len, *extra):
    result = run("synth", root, "--dist", "wlb", "--num-seqs", num_seqs, "--context-len", context_len,
                 "--no-tokens", *extra)
    assert result.exit_code == 0, result.output
    return root


def file_lens(root, index=0) -> list[np.ndarray]:
    """Every sequence's ``doc_lens`` of a data file, in row order."""
    dataset = Dataset(root)
    out = []
    for group in range(dataset.parquet(index).num_row_groups):
        offsets, lens = read_row_group_lens(dataset, index, group)
        out += [lens[offsets[i]:offsets[i + 1]] for i in range(offsets.size - 1)]
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("stream") / "data", 24, 4099)


def test_many_rows_hold_one_row_group_of_plans(tmp_path, monkeypatch):
    root = synth(tmp_path / "data", 4 * GROUP_ROWS + 100, 512, "--rows-per-file", 3 * GROUP_ROWS)
    alive: dict[int, tuple[int, int]] = {}  # live plan_rows results: id -> (rows, shards)
    peaks: list[tuple[int, int]] = []  # (rows, shards) alive whenever rows are planned or written

    def held() -> tuple[int, int]:
        return sum(r for r, _ in alive.values()), sum(s for _, s in alive.values())

    def tracked(*args, **kwargs):
        peaks.append(held())
        result = plan_rows(*args, **kwargs)
        key = id(result.shard_doc)
        alive[key] = (result.num_rows, int(result.shard_doc.size))
        weakref.finalize(result.shard_doc, alive.pop, key)  # the array dies with the last plan holding it
        return result

    writes = []
    write = plan_writer.PlanFileWriter.write

    def counted(self, table):
        writes.append(table.num_rows)
        peaks.append(held())
        write(self, table)

    monkeypatch.setattr(pipeline, "plan_rows", tracked)
    monkeypatch.setattr(compare, "plan_rows", tracked)  # the baselines
    monkeypatch.setattr(plan_writer.PlanFileWriter, "write", counted)
    result = run("plan", root, "--cp", 4, "--strategy", "flashcp+", "--compare", 10_000)  # every row compared
    assert result.exit_code == 0, result.output
    assert writes == [GROUP_ROWS] * 3 + [GROUP_ROWS, 100], "one plan row group per data row group"
    # the reference: each row group planned on its own; a baseline row planned alone
    groups = [file_lens(root, 0)[i:i + GROUP_ROWS] for i in range(0, 3 * GROUP_ROWS, GROUP_ROWS)]
    groups.append(file_lens(root, 1)[:GROUP_ROWS])
    group_shards = max(sum(plan_sequence("flashcp+", s, 4).num_shards for s in g) for g in groups)
    row_shards = max(plan_sequence(name, s, 4).num_shards for g in groups for s in g for name in BASELINES)
    # and the one-document sequence each kernel is warmed up on (pipeline.warm_up), which numba's first
    # dispatch may keep in a reference cycle until the cyclic collector runs
    warm = sum(plan_sequence(name, [512], 4).num_shards for name in ("flashcp+", *BASELINES))
    rows, shards = map(max, zip(*peaks))
    assert len(peaks) > 2 * (4 * GROUP_ROWS + 100), "every compared row planned with each baseline"
    assert rows <= GROUP_ROWS + 1 + 3, f"{rows} rows of plans held at once"
    assert shards <= group_shards + row_shards + warm, \
        f"{shards} shards held at once, one row group has {group_shards}"
    gc.collect()
    assert not alive


def test_streamed_plan_file_equals_planning_the_file_at_once(tmp_path):
    root = synth(tmp_path / "data", 2 * GROUP_ROWS + 7, 700)
    assert run("plan", root, "--cp", 3, "--strategy", "flashcp", "--compare", 0).exit_code == 0
    path = root / "plans" / "cp3-flashcp" / "part-00000.parquet"
    groups = [pq.ParquetFile(path).metadata.row_group(g).num_rows for g in range(3)]
    assert groups == [pq.ParquetFile(root / "data" / "part-00000.parquet").metadata.row_group(g).num_rows
                      for g in range(3)]
    sequences = file_lens(root)
    offsets = np.r_[0, np.cumsum([s.size for s in sequences])].astype(np.int64)
    whole = plan_rows(offsets, np.concatenate(sequences), 3, "flashcp", shape=DEFAULT_SHAPE)  # 'plan's default
    assert pq.read_table(path).equals(whole.table())
    assert run("verify", root).exit_code == 0


def test_compare_n_plans_baselines_on_evenly_spaced_sequences(small):
    result = run("plan", small, "--cp", 3, "--strategy", "flashcp", "--compare", 5, "--json", "--force")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["plan"]["summary"]
    compare = summary["compare"]
    assert compare["requested"] == 5 and compare["every_nth_sequence"] == 5 and compare["sequences"] == 5
    assert summary["baselines_every_nth_sequence"] == 5
    sequences = [file_lens(small)[i] for i in range(0, 24, 5)]
    model = objective_model({}, DEFAULT_SHAPE)  # priced for 'plan's default model
    for name in ("flashcp", *BASELINES):
        got = compare["strategy"] if name == "flashcp" else summary["baselines"][name]
        want = strategy_metrics(sequences, 3, name)
        steps = [plan_step_seconds(plan_sequence(name, s, 3), model) for s in sequences]
        assert got["sequences"] == 5
        assert got["imbalance_mean"] == pytest.approx(want["imbalance"].mean(), rel=1e-12)
        assert got["imbalance_max"] == pytest.approx(want["imbalance"].max(), rel=1e-12)
        assert got["a2a_comm_tokens_mean"] == pytest.approx(want["a2a_comm_tokens"].mean(), rel=1e-12)
        assert got["ag_comm_tokens_mean"] == pytest.approx(want["ag_comm_tokens"].mean(), rel=1e-12)
        assert got["step_seconds_mean"] == pytest.approx(np.mean(steps), rel=1e-12)
    assert compare["profile"].startswith("H100") and compare["model"]["num_heads"] == 32
    assert summary["sequences"] == 24 and "step_seconds_mean" not in summary
    # the sample is shown under a line, below the plan over every sequence, with a reading of it
    lines = result.stderr.splitlines()
    assert any("on the same 5 sequences (one in 5, the rows under the line)" in line for line in lines)
    cells = [[c.strip() for c in line.split("│")[:2]] for line in lines if "│" in line]
    assert cells == [["strategy", "seqs"], ["flashcp", "24"], ["flashcp", "5"], ["llama3", "5"], ["perdoc", "5"]]
    assert "┼" in lines[[i for i, line in enumerate(lines) if line.startswith(" flashcp ")][0] + 1]


def test_compare_zero_skips_the_baselines(small):
    result = run("plan", small, "--cp", 3, "--strategy", "flashcp", "--compare", 0, "--json", "--force")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["plan"]["summary"]
    assert summary["baselines"] == {} and summary["baselines_every_nth_sequence"] == 0
    assert summary["compare"] == {"requested": 0, "sequences": 0, "every_nth_sequence": 0}
    assert "llama3" not in result.stderr and "step ms" not in result.stderr and "fastest" not in result.stderr
    result = run("plan", small, "--cp", 3, "--compare", -1, "--force")
    assert result.exit_code == 2 and "-1 is not in the range x>=0" in result.output


def test_summary_compares_like_with_like_and_never_cuts_its_headers(small):
    result = run("plan", small, "--cp", 3, "--force")  # flashcp2, every sequence compared (24 < default)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "…" not in out and "..." not in out
    lines = out.splitlines()
    header = next(line for line in lines if "strategy" in line and "│" in line)
    assert header.split("│")[0].strip() == "strategy"
    assert [c.strip() for c in header.split("│")] == ["strategy", "seqs", "imb", "p50", "max", "AG", "EN",
                                                     "step ms"]
    rows = [line.split("│")[0].strip() for line in lines if "│" in line and line is not header]
    assert rows == ["flashcp2", "llama3", "perdoc"], "the plan's strategy first, one row each, no split"
    assert any(line.startswith("imb, p50, max: ") and "step ms: projected step time" in line for line in lines)
    meta = json.loads((small / "plans" / "cp3-flashcp2" / "plan.json").read_text())
    steps = {"flashcp2": meta["summary"]["compare"]["strategy"]["step_seconds_mean"],
             **{name: s["step_seconds_mean"] for name, s in meta["summary"]["baselines"].items()}}
    fastest = min(steps, key=steps.__getitem__)
    reading = next(line for line in lines if line.startswith("projected step time"))
    assert f"on these 24 sequences: {fastest} is fastest" in reading
    for name in set(steps) - {fastest}:
        assert f"{name} takes {steps[name] / steps[fastest]:.2f}x as long" in reading
    # today's keys stay: every summary key of before, and each baseline's
    keys = {"sequences", "imbalance_mean", "imbalance_p50", "imbalance_max", "ag_comm_tokens_mean",
            "a2a_comm_tokens_mean", "ag_saving_mean", "a2a_saving_mean"}
    assert keys | {"baselines", "baselines_every_nth_sequence"} <= set(meta["summary"])
    assert all(keys <= set(s) for s in meta["summary"]["baselines"].values())


def test_a_baseline_strategy_is_not_compared_with_itself(small):
    result = run("plan", small, "--cp", 3, "--strategy", "llama3", "--force", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)["plan"]["summary"]
    assert summary["baselines"]["llama3"] == summary["compare"]["strategy"]
    rows = [line.split("│")[0].strip() for line in result.stderr.splitlines() if "│" in line]
    assert rows == ["strategy", "llama3", "perdoc"]


def test_ls_sorts_plans_by_cp_then_strategy(small):
    for cp, strategy in ((16, "llama3"), (8, "perdoc"), (2, "ring"), (8, "llama3")):
        assert run("plan", small, "--cp", cp, "--strategy", strategy, "--compare", 0, "--force").exit_code == 0
    (small / "plans" / "aaa-unfinished").mkdir()
    result = run("ls", small, "--json")
    names = [p["name"] for p in json.loads(result.stdout)["plans"]]
    listed = [n for n in names if n in ("cp2-ring", "cp8-llama3", "cp8-perdoc", "cp16-llama3", "aaa-unfinished")]
    assert listed == ["cp2-ring", "cp8-llama3", "cp8-perdoc", "cp16-llama3", "aaa-unfinished"]
    text = run("ls", small).stdout
    assert text.index("cp8-perdoc") < text.index("cp16-llama3")
