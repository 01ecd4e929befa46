"""Gloo ranks on CPU for distributed tests: ``spawn`` (one spawn per world size, many cases per spawn) and
``torchrun`` (a script launched the way a user launches it).

A ``spawn`` worker collects its failures and raises them together at the end, after every rank has finished all
collectives, so one wrong number does not leave the other ranks hanging; ``torch.multiprocessing.spawn``
re-raises the worker's error (with its message) in the test process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from flashcp.train.launch import free_port, init_local_gloo

REPO = Path(__file__).resolve().parents[1]


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    init_local_gloo(rank, world_size, port, timeout=timedelta(seconds=60))
    try:
        failures = fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} failures:\n" + "\n".join(failures))


def spawn(fn, world_size: int, *args, start_method: str = "spawn") -> None:
    """Run ``fn(rank, world_size, *args) -> list[str]`` (failure messages) on ``world_size`` gloo ranks.

    ``start_method="fork"`` starts the ranks from this process's modules instead of importing them again: for
    tests whose imports cost seconds per rank (torchtitan).
    """
    mp.start_processes(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True,
                       start_method=start_method)


def torchrun(script: Path, *args, nproc: int = 2, timeout: int = 300) -> tuple[int, str]:
    """Run ``script`` under torchrun on ``nproc`` gloo ranks (this checkout first on the path, one thread each).

    Returns the exit status and the merged stdout and stderr; fails the test when the ranks do not finish within
    ``timeout`` seconds (torchrun and its workers are then killed together: they run in a session of their own).
    """
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(free_port()), str(script), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{Path(script).name} on {nproc} ranks did not finish within {timeout} s:\n{output[-5000:]}")
    return proc.returncode, output
