"""The batch planner and the registry: a strategy is one registry entry and its kernel file.

``tests/planner/toy_strategy.py`` is a kernel written outside flashcp; registering it (one ``Strategy``) is all
it takes for ``plan_sequence``, the pipeline, ``flashcp plan --strategy`` and ``flashcp verify`` to use it. A
kernel from outside flashcp is compiled in memory (the on-disk kernel cache is keyed by flashcp's own sources
only, so another package's kernel must never be loaded from it)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from flashcp import _numba
from flashcp.cli import cli
from flashcp.planner import batch, plan_sequence, register
from flashcp.planner.registry import STRATEGIES, Strategy
from flashcp.planner.strategies.baselines import ring_plan
from tests.planner.toy_strategy import reversed_ring_kernel

TOY = Strategy(name="toy-reversed-ring", defaults={"chunk_size": 64}, kernel=reversed_ring_kernel,
               kernel_params=("chunk",), description="the ring layout, rank order reversed")


@pytest.fixture
def toy():
    register(TOY)
    try:
        yield TOY
    finally:
        STRATEGIES.pop(TOY.name)


def test_one_registry_entry_plans_with_a_new_kernel(toy):
    rng = np.random.default_rng(3)
    for _ in range(20):
        lens = rng.integers(1, 500, rng.integers(1, 12))
        cp = int(rng.integers(1, 9))
        if lens.sum() < cp:
            continue
        plan = plan_sequence(toy.name, lens, cp, chunk_size=int(rng.integers(1, 100)))
        ring = ring_plan(lens, cp)  # the same chunks, rank i's on rank cp - 1 - i
        expected = sorted(zip(cp - 1 - ring.shard_rank, ring.shard_doc, ring.shard_start, ring.shard_len))
        assert list(zip(plan.shard_rank, plan.shard_doc, plan.shard_start, plan.shard_len)) == expected
    assert not toy.built_in and not isinstance(batch._dispatcher(toy)._cache, _numba._KernelCache)
    flashcp_loop = batch._dispatcher(STRATEGIES["flashcp"])
    assert isinstance(flashcp_loop._cache, _numba._KernelCache)  # flashcp's own cache on disk


def test_the_command_line_plans_and_verifies_with_it(toy, tmp_path):
    data = tmp_path / "d"
    runner = CliRunner()
    for args in (["synth", str(data), "--dist", "wlb", "--num-seqs", "6", "--context-len", "4096", "--no-tokens"],
                 ["plan", str(data), "--cp", "4", "--strategy", toy.name, "--compare", "2"],
                 ["verify", str(data)]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, result.output
    meta = json.loads((data / "plans" / f"cp4-{toy.name}" / "plan.json").read_text())
    assert meta["strategy"] == toy.name and meta["params"] == {"chunk_size": 64}


def test_a_strategy_entry_is_checked():
    with pytest.raises(ValueError, match="kernel parameters"):
        Strategy(name="bad", defaults={}, kernel=reversed_ring_kernel, kernel_params=("window",), description="")
    with pytest.raises(ValueError, match="already registered"):
        register(STRATEGIES["flashcp"])


def test_plan_batch_rows_are_the_single_sequence_plans():
    rng = np.random.default_rng(5)
    lens = [rng.integers(1, 3000, rng.integers(1, 15)) for _ in range(7)]
    offsets = np.r_[0, np.cumsum([x.size for x in lens])].astype(np.int64)
    flat = np.concatenate(lens).astype(np.int64)
    shard_offsets, *arrays = batch.plan_batch(offsets, flat, 4, STRATEGIES["flashcp"], target=1.05)
    for row, row_lens in enumerate(lens):
        one = plan_sequence("flashcp", row_lens, 4)
        lo, hi = shard_offsets[row], shard_offsets[row + 1]
        for got, want in zip(arrays, (one.shard_doc, one.shard_start, one.shard_len, one.shard_rank)):
            assert (got[lo:hi] == want).all()
