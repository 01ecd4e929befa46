"""Build the next batches off the training thread: ``Prefetcher`` runs a ``CPLoader`` on a background thread.

Building a batch (reading the row group, slicing the rank's tokens and labels, building the CPAttnMeta) is
host work of several milliseconds to tens of milliseconds at long contexts; done inline it sits on the
training loop's critical path every step. The prefetcher keeps ``depth`` batches built ahead in a bounded
queue, epoch after epoch, so the loop only takes the next one.

Why a thread and not DataLoader worker processes: the loader's exact resume state lives in one object (the
thread hands out, with each batch, the loader state right after it, so ``state_dict()`` is exact whatever
was built ahead), nothing is pickled between processes (a CPAttnMeta is dozens of small tensors), and the
training thread spends its time in kernels and collectives that release the GIL (CUDA launches and
synchronisation, NCCL or gloo waits), while the batch building is mostly NumPy and Arrow work. With
``pin_memory`` the token tensors are pinned on the thread, so a ``Batch.to(cuda)`` of them may copy
asynchronously.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from flashcp.runtime.loader import Batch, CPLoader

__all__ = ["Prefetcher"]

_STOP = object()


class Prefetcher:
    """Endless batches of ``loader`` (epoch after epoch), built ``depth`` ahead on a background thread.

    Args:
        loader: the CPLoader; restore its state (``load_state_dict``) before creating the prefetcher, and do
            not iterate it elsewhere afterwards.
        depth: batches built ahead (at least 1).
        pin_memory: pin the token tensors (for an asynchronous copy to a GPU).

    ``state_dict()`` is the loader state after the last batch handed out; ``host_seconds`` lists the time the
    thread spent building each batch. Use as a context manager, or call ``close()``.
    """

    def __init__(self, loader: CPLoader, depth: int = 2, pin_memory: bool = False):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.loader, self.pin_memory = loader, pin_memory
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.host_seconds: list[float] = []
        self._thread = threading.Thread(target=self._run, name="flashcp-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batches = iter(self.loader)
                while True:
                    began = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        break
                    if self.pin_memory:
                        batch = replace(batch, input_ids=batch.input_ids.pin_memory(),
                                        position_ids=batch.position_ids.pin_memory(),
                                        labels=batch.labels.pin_memory())
                    self.host_seconds.append(time.perf_counter() - began)
                    if not self._put((batch, self.loader.state_dict())):
                        return
                if len(self.loader) == 0:
                    raise ValueError("the loader holds no sequences")
        except BaseException as e:  # handed to the training thread, raised there
            self._put((_STOP, e))

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Batch]:
        """The batches, endlessly."""
        return self

    def __next__(self) -> Batch:
        """The next batch (waits only when none is built yet)."""
        batch, state = self._queue.get()
        if batch is _STOP:
            raise state
        self._state = state
        return batch

    def state_dict(self) -> dict:
        """The loader state right after the last batch handed out (for checkpoints)."""
        return dict(self._state)

    def close(self) -> None:
        """Stop the thread and drop the batches built ahead."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
