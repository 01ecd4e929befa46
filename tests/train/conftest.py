"""Fixtures of the training tests."""

import numpy as np
import pytest

from tests.plans import llama3_like_plan, write_dataset, write_plan
from tests.train import CONTEXT


@pytest.fixture
def planned(tmp_path):
    rng = np.random.default_rng(4)
    rows = [np.array([7, 1, 20, 12]), np.array([40]), np.array([3, 3, 34])]
    dataset, tokens = write_dataset(tmp_path / "data", [rows], CONTEXT, rng)
    for cp in (1, 2):
        write_plan(dataset, f"cp{cp}-llama3-like", [[llama3_like_plan(lens, cp) for lens in rows]], cp)
    return tmp_path / "data", list(zip(tokens[0], rows))
