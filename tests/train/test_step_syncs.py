"""Host syncs and copies of a training step, counted on CPU with the emulated GPU kernels.

A sync is a call that makes the host wait for a device: ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``float()`` / ``int()`` / ``bool()`` of a tensor, ``torch.cuda.synchronize``. The counter patches those on
``torch.Tensor`` and counts the calls made by flashcp's own code on the training thread, while the loop's
``_step`` runs: 2 gloo ranks, bf16, the flash-attn 2.8 emulation on a device that says compute capability
9.0, so the GPU code path runs. A step must make exactly one, after ``optimizer.step()``: CP only (cp 2) and
data parallel (dp 2, where the label count is summed over the replicas). Also: the meta moves as one copy
holding only the chosen comm mode's tensors, and the gradient buffers persist across steps.
"""

import collections
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import flashcp
from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.runtime.meta import CPAttnMeta
from tests import fake_kernels
from tests.dist import spawn
from tests.emulate import random_plan
from tests.plans import llama3_like_plan, write_dataset, write_plan

FLASHCP = str(Path(flashcp.__file__).resolve().parent)
SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
CONTEXT, STEPS = 48, 3


class SyncCounter:
    """Counts, per ``file:line``, the syncing calls flashcp code makes on this thread while ``active``."""

    def __init__(self):
        self.active = False
        self.events: list[str] = []
        self.thread = threading.current_thread()
        self.saved = {}

    def _wrap(self, name, original):
        counter = self

        def wrapper(*args, **kwargs):
            if counter.active and threading.current_thread() is counter.thread:
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(FLASHCP):
                    where = Path(caller.f_code.co_filename).relative_to(FLASHCP)
                    counter.events.append(f"{name} at {where}:{caller.f_lineno}")
            return original(*args, **kwargs)
        return wrapper

    def __enter__(self):
        for name in SYNC_METHODS:
            self.saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        self.saved[(torch.cuda, "synchronize")] = torch.cuda.synchronize
        torch.cuda.synchronize = self._wrap("torch.cuda.synchronize", torch.cuda.synchronize)
        step = torch.optim.AdamW.step
        self.saved[(torch.optim.AdamW, "step")] = step

        def optimizer_step(optimizer, *args, **kwargs):
            if self.active:
                self.events.append("optimizer.step")
            return step(optimizer, *args, **kwargs)
        torch.optim.AdamW.step = optimizer_step
        return self

    def __exit__(self, *exc):
        for (owner, name), value in self.saved.items():
            setattr(owner, name, value)


def _worker(rank, world, root, plan, dp):
    from flashcp.train import loop
    from flashcp.train.loop import TrainOptions, run_training

    undo = fake_kernels.install("flash_attn-2.8")
    failures = []
    with SyncCounter() as counter:
        original = loop._step

        def counted_step(*args, **kwargs):
            counter.events.append("step begins")
            counter.active = True
            try:
                return original(*args, **kwargs)
            finally:
                counter.active = False
        loop._step = counted_step
        try:
            options = TrainOptions(data=root, plan=plan, steps=STEPS, dtype="bfloat16", vocab_size=32, dim=32,
                                   num_layers=2, num_heads=4, num_kv_heads=2, dp=dp, shuffle=False, prefetch=1)
            logs = run_training(options)
        finally:
            loop._step = original
            undo()
    steps = " | ".join(counter.events).split("step begins")[1:]
    per_step = [[e for e in s.strip(" |").split(" | ") if e] for s in steps]
    syncs = [[e for e in s if e != "optimizer.step"] for s in per_step]
    if len(per_step) != STEPS or len(logs) != STEPS:
        failures.append(f"rank {rank}: {len(per_step)} steps counted, {len(logs)} logged")
    for i, events in enumerate(per_step):
        if len(syncs[i]) != 1 or events.index("optimizer.step") > events.index(syncs[i][0]):
            failures.append(f"dp {dp} rank {rank} step {i + 1}: syncs {syncs[i]} (want one, after the "
                            f"optimizer step); events in order: {events}")
    if rank == 0:
        print(f"dp {dp}: host syncs per step {[len(s) for s in syncs]}: {syncs[0]}")
    return failures


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs") / "data"
    rng = np.random.default_rng(3)
    rows = [np.array([9, 1, 30, 8]), np.array([48]), np.array([20, 28])]
    dataset, _ = write_dataset(root, [rows], CONTEXT, rng)
    for cp in (1, 2):
        write_plan(dataset, f"cp{cp}-llama3-like", [[llama3_like_plan(lens, cp) for lens in rows]], cp)
    return str(root)


@pytest.mark.slow
@pytest.mark.parametrize("plan, dp", [("cp2-llama3-like", 1), ("cp1-llama3-like", 2)])
def test_one_host_sync_per_step_after_the_optimizer_step(planned, plan, dp, capfd):
    spawn(_worker, 2, planned, plan, dp)
    print(capfd.readouterr().out)


def test_meta_moves_as_one_copy_of_the_chosen_mode():
    doc_lens = np.array([9, 1, 14, 4])
    plan = random_plan(doc_lens, 3, np.random.default_rng(0), max_pieces=3)
    meta = CPAttnMeta.from_plan(plan, doc_lens, 1)
    copies = collections.Counter()
    original = torch.Tensor.to

    def to(tensor, *args, **kwargs):
        copies[str(args[0] if args else kwargs.get("device"))] += 1
        return original(tensor, *args, **kwargs)

    torch.Tensor.to = to
    try:
        moved = meta.to("meta", comm="a2a")
        again = moved.to("meta", comm="a2a")
    finally:
        torch.Tensor.to = original
    assert copies == {"meta": 1} and again is moved
    assert moved.exchanges["a2a"].kv_index.device.type == "meta" and moved.local.q_index.device.type == "meta"
    assert moved.exchanges["allgather"].kv_index.device.type == "cpu"  # not the chosen mode: not moved
    assert moved.ring.steps[0].part.q_index.device.type == "cpu"
    assert moved.exchanges["a2a"].kv_index.dtype == torch.int64 and moved.local.cu_seqlens_q.dtype == torch.int32
    ring = meta.to("meta", comm="ring")
    assert ring.ring.steps[1].kv_index.device.type == "meta" and ring.exchanges["a2a"].kv_index.device.type == "cpu"
    everything = meta.to("meta")
    for mode, exchange in meta.exchanges.items():  # the copy keeps every value
        moved_index = everything.exchanges[mode].kv_index
        assert moved_index.device.type == "meta" and moved_index.shape == exchange.kv_index.shape


def test_gradient_buffers_persist_across_steps(tmp_path):
    from flashcp.runtime import CPLoader
    from flashcp.train import fold_vocab, train_step

    rows = [np.array([7, 1, 20, 12]), np.array([40])]
    dataset, _ = write_dataset(tmp_path / "data", [rows], 40, np.random.default_rng(5))
    write_plan(dataset, "cp1-llama3-like", [[llama3_like_plan(lens, 1) for lens in rows]], 1)
    loader = iter(CPLoader(tmp_path / "data", "cp1-llama3-like", 0, 1, shuffle=False))
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(vocab_size=16, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, ffn_dim=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, fold_vocab(next(loader), 16))
    held = [p.grad for p in model.parameters()]
    train_step(model, optimizer, fold_vocab(next(loader), 16))
    now = [p.grad for p in model.parameters()]
    assert all(a.data_ptr() == b.data_ptr() and torch.equal(a, b) for a, b in zip(held, now))
    assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1  # one flat buffer
