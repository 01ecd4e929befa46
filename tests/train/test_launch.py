"""flashcp.train.launch: a script's process group is set up from torchrun's environment and always destroyed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from flashcp.train.launch import ending_together, free_port, torchrun_group


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for one rank."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def test_torchrun_group_initialises_from_the_environment_and_destroys_the_group(one_rank):
    with torchrun_group() as launch:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert (launch.distributed, launch.rank) == (True, 0)
        assert launch.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert not dist.is_initialized()


def test_the_group_is_destroyed_when_the_work_raises(one_rank):
    with pytest.raises(RuntimeError, match="the work failed"), torchrun_group():
        raise RuntimeError("the work failed")
    assert not dist.is_initialized()


def test_without_torchrun_the_block_runs_as_one_process(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with torchrun_group() as launch:
        assert not dist.is_initialized()
        assert (launch.distributed, launch.rank) == (False, 0)
    with ending_together():  # nothing to end: no barrier, no error
        pass
    assert not dist.is_initialized()


def test_ending_together_destroys_a_group_someone_else_started(one_rank):
    dist.init_process_group("gloo")
    with ending_together():
        assert dist.is_initialized()
    assert not dist.is_initialized()
