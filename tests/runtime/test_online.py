"""Online planning (CPLoader with plan=None): the batches, metas and order of a stored default plan, resumable,
and importing the runtime still loads no planning kernel until a loader plans."""

import json

import numpy as np
import pytest

from flashcp.errors import FlashcpError
from flashcp.planner.pipeline import plan_dataset
from flashcp.planner.registry import DEFAULT_STRATEGY
from flashcp.runtime import CPLoader
from tests.naive_meta import assert_same_batches
from tests.plans import write_dataset

CONTEXT, CP = 512, 2


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Two data files (5 + 4 rows, row groups of 2) planned by 'flashcp plan --cp 2' (the default strategy)."""
    root = tmp_path_factory.mktemp("online") / "data"
    rng = np.random.default_rng(4)
    files = []
    for n in (5, 4):
        rows = []
        for _ in range(n):
            cuts = np.sort(rng.choice(np.arange(1, CONTEXT), size=int(rng.integers(0, 12)), replace=False))
            rows.append(np.diff(np.r_[0, cuts, CONTEXT]))
        files.append(rows)
    write_dataset(root, files, CONTEXT, rng, row_group_rows=2)
    plan_dataset(root, CP, DEFAULT_STRATEGY, compare=0)
    return root, f"cp{CP}-{DEFAULT_STRATEGY}"


@pytest.mark.parametrize("dp", [1, 2])
def test_online_plans_equal_the_stored_ones(planned, dp):
    root, name = planned
    for rank in range(CP):
        for d in range(dp):
            online = CPLoader(root, None, rank, CP, dp_rank=d, dp_size=dp, seed=3, balance_window=2)
            stored = CPLoader(root, name, rank, CP, dp_rank=d, dp_size=dp, seed=3, balance_window=2)
            assert_same_batches(list(online) + list(online), list(stored) + list(stored))


def test_online_loader_resumes_and_refuses(planned):
    root, _ = planned
    loaders = [CPLoader(root, None, 0, CP, dp_rank=d, dp_size=2, seed=1) for d in range(2)]
    for loader in loaders:  # one step
        next(iter(loader))
    state = json.loads(json.dumps(loaders[0].state_dict()))
    assert state["plan"] is None
    again = [CPLoader(root, None, 0, CP, dp_rank=d, dp_size=2, seed=1) for d in range(2)]
    expected = [list(loader)[1:] for loader in again]
    for d in range(2):
        resumed = CPLoader(root, None, 0, CP, dp_rank=d, dp_size=2)
        resumed.load_state_dict(state)
        assert_same_batches(list(resumed), expected[d])
    with pytest.raises(FlashcpError, match="cannot plan sequences of 512 tokens for 1024 ranks"):
        CPLoader(root, None, 0, 1024)
