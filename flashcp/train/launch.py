"""Process-group set-up and tear-down for scripts: under torchrun, and for gloo ranks started on one machine.

A script run by torchrun wraps its work in ``torchrun_group()``; a script whose process group another library
starts (the Hugging Face Trainer through accelerate) wraps its work in ``ending_together()``. Both end the group
the same way: after the work, a barrier (a rank tearing down while a peer still talks to it can abort the peer),
and in any case ``destroy_process_group`` (a group still alive at interpreter exit can abort a rank with
SIGABRT). Code that starts its own ranks on this machine (tests, ``flashcp bench``) takes a port from
``free_port()`` and joins with ``init_local_gloo``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["Launch", "ending_together", "free_port", "init_local_gloo", "torchrun_group"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """How this process was launched."""

    distributed: bool
    """True under torchrun (``RANK`` set): a process group is initialised; False: one process, no group."""
    rank: int
    """This process's global rank (0 without torchrun)."""
    device: torch.device
    """``cuda:LOCAL_RANK`` when CUDA is available (and made the current device), else the CPU."""


@contextmanager
def ending_together() -> Iterator[None]:
    """Run the block; then a barrier if it succeeded, and in any case destroy the process group if one is alive."""
    try:
        yield
        if dist.is_initialized():
            dist.barrier()
    finally:  # also when something unexpected escapes: never exit with the process group alive
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def torchrun_group() -> Iterator[Launch]:
    """Initialise the process group torchrun describes (NCCL with CUDA, else gloo) and end it with the block.

    Without torchrun (no ``RANK`` in the environment) the block runs as one process without a group.
    """
    distributed = "RANK" in os.environ
    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    with ending_together():
        yield Launch(distributed=distributed, rank=dist.get_rank() if distributed else 0, device=device)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous of ranks on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_gloo(rank: int, world_size: int, port: int, timeout: timedelta | None = None) -> None:
    """Join a gloo group of ``world_size`` processes on this machine (rendezvous at ``127.0.0.1:port``).

    One intra-op thread per rank: the ranks share the machine's cores.
    """
    torch.set_num_threads(1)
    init_method = f"tcp://127.0.0.1:{port}"
    if timeout is None:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
