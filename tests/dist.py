"""Spawn gloo ranks on CPU for distributed tests: one spawn per world size, many cases per spawn.

A worker collects its failures and raises them together at the end, after every rank has finished all
collectives, so one wrong number does not leave the other ranks hanging; ``torch.multiprocessing.spawn``
re-raises the worker's error (with its message) in the test process.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
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
