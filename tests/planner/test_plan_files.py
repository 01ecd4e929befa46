"""Plan files (planner.plan_writer, plan_reader): written a row group at a time, read back as the planner made them."""

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from flashcp.cli import cli
from flashcp.costmodel.models import BUILTIN_MODELS, LayerKind
from flashcp.costmodel.objective import sequence_flops
from flashcp.costmodel.shape import AttentionShape
from flashcp.data.dataset import Dataset
from flashcp.errors import PlanError
from flashcp.fileio import sha256_file
from flashcp.planner import plan_sequence
from flashcp.planner.pipeline import plan_dataset
from flashcp.planner.plan_reader import CP_KEY, PLAN_SCHEMA, SEQ_COST, PlanStore
from flashcp.planner.plan_writer import PlanFileWriter, plan_table
from tests.plans import write_plan


def _table(plans):
    offsets = np.r_[0, np.cumsum([p.shard_doc.size for p in plans])]
    cat = lambda name: np.concatenate([getattr(p, name) for p in plans])  # noqa: E731
    n = len(plans)
    return plan_table(offsets, cat("shard_doc"), cat("shard_start"), cat("shard_len"), cat("shard_rank"),
                      np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.int64), np.ones(n))


def test_row_groups_round_trip_with_cp_in_the_footer(tmp_path):
    rng = np.random.default_rng(1)
    plans = [plan_sequence("flashcp", rng.integers(1, 900, rng.integers(1, 9)), 4) for _ in range(5)]
    writer = PlanFileWriter(tmp_path, 3, cp=4)
    writer.write(_table(plans[:2]))
    writer.write(_table(plans[2:]))
    entry = writer.close()
    path = tmp_path / "part-00003.parquet"
    assert entry["path"] == path.name and entry["rows"] == 5 and entry["sha256"] == sha256_file(path)
    parquet = pq.ParquetFile(path)
    assert parquet.num_row_groups == 2 and parquet.schema_arrow.metadata[CP_KEY] == b"4"
    table = parquet.read()
    assert table.schema.remove_metadata() == PLAN_SCHEMA.remove_metadata()
    for row, plan in enumerate(plans):
        assert table.column("shard_rank")[row].as_py() == plan.shard_rank.tolist()
        assert table.column("shard_start")[row].as_py() == plan.shard_start.tolist()


def test_a_value_that_does_not_fit_its_column_is_refused():
    """A rank of 2^15 in the int16 column, a document index of 2^31 in the int32 one: ArrowInvalid, not a wrap."""
    plan = plan_sequence("llama3", [5, 9], 2)
    for name, value in (("shard_rank", 1 << 15), ("shard_doc", 1 << 31)):
        arrays = {n: getattr(plan, n).copy() for n in ("shard_doc", "shard_start", "shard_len", "shard_rank")}
        arrays[name][0] = value
        with pytest.raises(pa.ArrowInvalid, match=f"value {value} does not fit"):
            plan_table(np.array([0, plan.num_shards]), *arrays.values(), np.ones(1), np.zeros(1, np.int64),
                       np.zeros(1, np.int64), np.ones(1))


def test_an_aborted_writer_leaves_what_was_there(tmp_path):
    old = tmp_path / "part-00000.parquet"
    old.write_bytes(b"the previous plan file")
    writer = PlanFileWriter(tmp_path, 0, cp=2)
    writer.write(_table([plan_sequence("llama3", [5, 7], 2)]))
    writer.abort()
    assert old.read_bytes() == b"the previous plan file"
    assert sorted(p.name for p in tmp_path.iterdir()) == [old.name]


def test_the_store_reads_back_what_plan_wrote(tmp_path):
    data = tmp_path / "d"
    runner = CliRunner()
    for args in (["synth", str(data), "--dist", "pile", "--num-seqs", "9", "--context-len", "8192", "--no-tokens",
                  "--rows-per-file", "4"],
                 ["plan", str(data), "--cp", "8", "--strategy", "flashcp+", "--compare", "0"]):
        assert runner.invoke(cli, args).exit_code == 0
    dataset = Dataset(data)
    store = PlanStore(dataset, "cp8-flashcp+")
    assert store.cp == 8 and len(store.plan_files) == 3
    for index, data_file in enumerate(dataset.files):
        lens = pq.read_table(dataset.path(data_file), columns=["doc_lens"]).column("doc_lens").to_pylist()
        stored = list(store.iter_plans(index))
        assert len(stored) == len(lens)
        for row_lens, one in zip(lens, stored):
            want = plan_sequence("flashcp+", row_lens, 8)
            assert (one.plan.shard_rank == want.shard_rank).all() and (one.plan.shard_len == want.shard_len).all()
    meta = json.loads((data / "plans" / "cp8-flashcp+" / "plan.json").read_text())
    meta["cp"] = 4
    (data / "plans" / "cp8-flashcp+" / "plan.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="cp"):
        PlanStore(Dataset(data), "cp8-flashcp+")


def test_sequence_costs_are_stored_and_old_plans_are_priced_on_read(tmp_path):
    data = tmp_path / "d"
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", str(data), "--dist", "wlb", "--num-seqs", "7", "--context-len", "8192",
                                 "--no-tokens", "--rows-per-file", "4"])
    assert result.exit_code == 0, result.output
    # a model of 3 layers (flashcp2's shape parameters follow the model; its per-token FLOPs are priced too)
    model = replace(BUILTIN_MODELS["llama-3-8b"], name="llama-3-3-layers", layers=(LayerKind(),) * 3)
    plan_dataset(data, 4, "flashcp2", compare=0, model=model)
    dataset = Dataset(data)
    store = PlanStore(dataset, "cp4-flashcp2")
    assert store.cost_shape == model.attention_shape() and store.cost_shape.layers == 3
    assert store.meta["params"]["layers"] == 3 and store.meta["params"]["num_kv_heads"] == 8
    old_rows = []
    for index in range(len(dataset.files)):
        offsets, lens = dataset.read_doc_lens(index)
        expected = sequence_flops(offsets, lens, store.cost_shape)
        stored = np.array([p.seq_cost for p in store.iter_plans(index)])
        assert np.allclose(stored, expected, rtol=1e-12, atol=0) and np.array_equal(store.seq_costs(index), stored)
        assert np.array_equal(store.read_flat(index)["seq_cost"], stored)
        old_rows.append([p.plan for p in store.iter_plans(index)])
        store.check_row(next(store.iter_plans(index)), lens[offsets[0]:offsets[1]], index, 0)
        with pytest.raises(PlanError, match="sequence cost"):
            store.check_seq_cost(float(expected[0]) * (1 + 1e-9), lens[offsets[0]:offsets[1]])
    # a plan file written before the column: readers price the sequences from the data
    write_plan(dataset, "cp4-old", old_rows, 4, seq_cost=False)
    old = PlanStore(dataset, "cp4-old")
    assert SEQ_COST not in pq.ParquetFile(old.plan_path(0)).schema_arrow.names
    for index in range(len(dataset.files)):
        offsets, lens = dataset.read_doc_lens(index)
        assert np.allclose(old.seq_costs(index), sequence_flops(offsets, lens, AttentionShape()), rtol=1e-12)
        assert all(p.seq_cost is None for p in old.iter_plans(index))
        assert "seq_cost" not in old.read_flat(index)
