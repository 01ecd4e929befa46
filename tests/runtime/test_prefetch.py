"""Prefetcher: the loader's batches in the same order, an exact state for checkpoints, errors passed on."""

import numpy as np
import pytest

from flashcp.errors import FlashcpError
from flashcp.runtime import CPLoader
from flashcp.runtime.prefetch import Prefetcher
from tests.emulate import random_plan
from tests.plans import write_dataset, write_plan

CONTEXT, CP = 16, 2


@pytest.fixture
def root(tmp_path):
    rng = np.random.default_rng(3)
    rows = [np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, CONTEXT), 3, replace=False)), CONTEXT])
            for _ in range(5)]
    dataset, _ = write_dataset(tmp_path / "data", [rows], CONTEXT, rng, row_group_rows=2)
    write_plan(dataset, "cp2-test", [[random_plan(lens, CP, rng) for lens in rows]], CP)
    return dataset.root


def key(batch):
    return batch.file_index, batch.row, batch.input_ids.tolist()


def test_same_batches_and_an_exact_state(root):
    plain = CPLoader(root, "cp2-test", 1, CP, dp_rank=1, dp_size=2, seed=2)
    states, expected = [], []
    while len(expected) < 8:  # across epochs
        for batch in plain:
            expected.append(key(batch))
            states.append(plain.state_dict())
            if len(expected) == 8:
                break
    with Prefetcher(CPLoader(root, "cp2-test", 1, CP, dp_rank=1, dp_size=2, seed=2), depth=3) as prefetcher:
        got = []
        for batch in prefetcher:
            got.append(key(batch))
            assert prefetcher.state_dict() == states[len(got) - 1], f"state after {len(got)} batches"
            if len(got) == 5:
                break
        state = prefetcher.state_dict()
        assert len(prefetcher.host_seconds) >= 5
    resumed = CPLoader(root, "cp2-test", 1, CP, dp_rank=1, dp_size=2, seed=0)
    resumed.load_state_dict(state)
    with Prefetcher(resumed, depth=1) as prefetcher:
        got += [key(next(prefetcher)) for _ in range(3)]
    assert got == expected


def test_a_failure_on_the_thread_is_raised_in_the_loop(root, monkeypatch):
    loader = CPLoader(root, "cp2-test", 0, CP, shuffle=False)
    original = CPLoader._sequence
    calls = []

    def failing(self, epoch, index):
        calls.append(index)
        if len(calls) == 3:
            raise FlashcpError("data file x is corrupt")
        return original(self, epoch, index)

    monkeypatch.setattr(CPLoader, "_sequence", failing)
    with Prefetcher(loader) as prefetcher:
        next(prefetcher), next(prefetcher)
        with pytest.raises(FlashcpError, match="data file x is corrupt"):
            next(prefetcher)
    with pytest.raises(ValueError, match="depth must be at least 1"):
        Prefetcher(loader, depth=0)
