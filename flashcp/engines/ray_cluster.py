"""Joining or starting the Ray cluster that ``--engine ray`` runs on."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from flashcp.errors import FlashcpError

__all__ = ["cluster_cpus", "get_result", "ray_session", "require_ray"]


def require_ray():
    """The ``ray`` module, or a one-sentence FlashcpError saying what to install."""
    try:
        import ray
    except ImportError:
        raise FlashcpError("--engine ray needs Ray, which is not installed; install it with "
                           "pip install 'flashcp[ray]'") from None
    return ray


@contextmanager
def ray_session(address: str | None = None, workers: int | None = None) -> Iterator:
    """Yield ``ray`` connected to a cluster.

    That is the one already joined, the one at ``address`` (``auto`` finds a running one), or else a local one
    started here with ``workers`` CPUs (all cores when None).
    A cluster started here is shut down on exit; one joined is left running.
    """
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    if address is not None:
        _check_reachable(address)
    options = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    try:
        if address is None:
            # Ray runs its workers at nice 15; the local engine's run at the caller's priority, and so do these
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(num_cpus=workers, **options)
        else:
            ray.init(address=address, **options)
    except (ConnectionError, ValueError, RuntimeError) as e:
        where = f"at {address}" if address else "on this machine"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashcpError(f"cannot start or join a Ray cluster {where} ({reason})") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def cluster_cpus(ray) -> int:
    """CPUs the cluster offers (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def get_result(ray, ref):
    """``ray.get``, with a task's FlashcpError or OSError raised as itself (one sentence, as locally)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, FlashcpError | OSError):
            raise e.cause from None
        raise


def _check_reachable(address: str) -> None:
    """Refuse a ``host:port`` nothing listens on at once (Ray itself retries it for minutes)."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return  # "auto", ray:// client addresses: Ray reports those itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise FlashcpError(f"no Ray cluster answers at {address} ({e.strerror or e}); start one with "
                           "'ray start --head' or leave out --ray-address to start Ray here") from None
