"""The ``dcp`` peer: DCP's hypergraph formulation on Mt-KaHyPar, converted to valid plans."""

import numpy as np
import pytest

from flashcp.costmodel.comm import exact_need_sent
from flashcp.costmodel.workload import token_quotas, workload
from flashcp.planner.plan import SequencePlan
from flashcp.planner.planning import plan_sequence
from flashcp.planner.strategies import dcp as hypergraph


def test_refuses_in_one_sentence_without_the_package(monkeypatch, tmp_path):
    from click.testing import CliRunner

    import flashcp.planner.registry as strategies
    from flashcp.cli import cli
    from flashcp.planner.params import kernel_args

    entry = _without_package(strategies.STRATEGIES["dcp"])
    with pytest.raises(ValueError, match="needs the hypergraph partitioner mtkahypar"):
        kernel_args(entry, {"chunk_size": 512})
    root = tmp_path / "d"
    assert CliRunner().invoke(cli, ["synth", str(root), "--dist", "wlb", "--num-seqs", "2", "--context-len", "4096",
                                    "--no-tokens"]).exit_code == 0
    monkeypatch.setitem(strategies.STRATEGIES, "dcp", entry)
    result = CliRunner().invoke(cli, ["plan", str(root), "--cp", "2", "--strategy", "dcp"])
    assert result.exit_code == 1 and "pip install 'flashcp[hypergraph]'" in result.output
    assert "Traceback" not in result.output and not (root / "plans" / "cp2-dcp").exists()


def _without_package(entry):
    from dataclasses import replace

    return replace(entry, missing=lambda: hypergraph.MISSING)


needs_mtkahypar = pytest.mark.skipif(not hypergraph.dcp_available(), reason="pip install 'flashcp[hypergraph]'")


@needs_mtkahypar
def test_connectivity_objective_is_the_exact_need_volume():
    """The partition's KM1 (sum over nets of weight x (lambda - 1)) is the total exact-need K/V the block
    plan sends: the formulation prices exactly what a rank receives."""
    rng = np.random.default_rng(3)
    for _ in range(4):
        lens = rng.integers(1, 5000, rng.integers(2, 20)).astype(np.int64)
        cp = int(rng.integers(2, 6))
        doc, start, length = hypergraph.dcp_blocks(lens, 256)
        part = hypergraph.partition_blocks(doc, start, length, cp)
        km1 = 0
        for b in range(doc.size):
            later = np.flatnonzero((doc == doc[b]) & (start >= start[b]))
            km1 += int(length[b]) * (len(set(part[later].tolist())) - 1)
        plan = SequencePlan.from_arrays(doc, start, length, part, cp=cp)
        assert km1 == int(exact_need_sent(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank,
                                          cp).sum())


@needs_mtkahypar
@pytest.mark.parametrize("cp", [1, 3, 8])
def test_plans_are_valid_with_exact_quotas(cp):
    rng = np.random.default_rng(cp)
    for _ in range(3):
        lens = rng.integers(1, 9000, rng.integers(1, 25)).astype(np.int64)
        if lens.sum() < cp:
            continue
        plan = plan_sequence("dcp", lens, cp)
        plan.validate(lens)
        tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp)
        assert np.array_equal(tokens, token_quotas(int(lens.sum()), cp))
        assert int(workload(plan.shard_start, plan.shard_len).sum()) == int(workload(0, lens).sum())
        assert plan_sequence("dcp", lens, cp).metrics() == plan.metrics()  # deterministic


def test_vertex_weights_fit_the_partitioners_32_bits():
    small = np.array([1, 5, 1000], np.int64)
    assert np.array_equal(hypergraph.vertex_weights(small), small)  # unchanged while they fit
    work = workload(*hypergraph.dcp_blocks(np.array([1048576, 3], np.int64), 1024)[1:])
    assert int(work.sum()) > 2**31  # one 1M document: 5.5e11 query-key pairs
    got = hypergraph.vertex_weights(work)
    assert int(got.sum()) < 2**31 - 1 and got.min() >= 1
    scale = work.sum() / got.sum()
    assert np.all(np.abs(got * scale - work) <= np.maximum(scale, 1e-3 * work))  # proportional, rounded


@needs_mtkahypar
def test_plans_documents_too_long_for_32_bit_weights():
    """A 128K document has 8.6e9 query-key pairs, more than Mt-KaHyPar's int32 vertex weights hold."""
    lens = np.array([131072 - 9000, 5000, 4000], np.int64)
    plan = plan_sequence("dcp", lens, 8)
    plan.validate(lens)
    assert np.array_equal(np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=8),
                          token_quotas(int(lens.sum()), 8))
