"""The training loop behind ``examples/train_tiny.py``: set up, agree, train, log, checkpoint, resume.

``run_training`` runs on every rank of the CP group (or in a single process for a cp-1 plan). With ``dp`` > 1
or ``sharding="fsdp"`` the launched ranks form a ``(dp, cp)`` DeviceMesh (``flashcp.train.parallel``): each
replica trains on its own sequences, one global batch of ``dp`` sequences per step; FSDP2 runs save
``torch.distributed.checkpoint`` folders, the others one file. Batches are built ``prefetch`` ahead on a
background thread (``flashcp.runtime.prefetch``). Set-up (open the
dataset and plan, build the model, load the checkpoint) can fail on bad input; the ranks then exchange their
errors once, before any training collective, and every rank raises the same FlashcpError, so a mismatched
plan or a missing checkpoint stops the whole group with one sentence instead of leaving some ranks waiting.

Each step logs, on rank 0: the sequence's mean loss, tokens per second (the packed sequence's tokens over the
step's wall time, data loading included), and the K/V bytes the attention exchange moved (forward K/V plus
backward dK/dV, all layers: the busiest rank's sent+received, and the sum over ranks). A step makes one host
sync (``train_step``'s read after the optimizer step, which brings every rank's byte counts too); the ranks
leave the step after the same collectives, so one rank's wall time is the slowest rank's up to its local
optimizer update. The parameter dtype defaults to bfloat16 on CUDA (the GPU attention kernels need 16-bit
inputs) and float32 elsewhere.

The learning rate of each optimizer step comes from ``options.lr_schedule`` (``flashcp.train.schedule``: warm-up,
then constant, cosine or linear decay), a function of the step number that checkpoints record, so a resume
continues the same curve.

The caller brings what the loop does not choose itself: the model (a ``ModelBuilder``; ``build_tiny_model``
by default, ``flashcp.integrations.models.build_model`` for every ``--model`` name) and the progress bar (a
``ProgressFn`` such as ``flashcp.cli.console.progress``; None: no bar).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashcp.costmodel.models import LayerKind, ModelSpec
from flashcp.errors import FlashcpError
from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.runtime import CPLoader
from flashcp.runtime.loader import Batch
from flashcp.runtime.prefetch import Prefetcher
from flashcp.train.checkpoint import (
    check_checkpoint_target,
    load_checkpoint,
    load_sharded_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)
from flashcp.train.loss import LossSumFn, tiny_loss_sum
from flashcp.train.parallel import SHARDING_MODES, FsdpFn, ParallelGroups, build_mesh, shard_model
from flashcp.train.schedule import LRSchedule
from flashcp.train.step import agree_on_errors, fold_vocab, group_rank, group_size, train_step

__all__ = ["DTYPES", "LRSchedule", "ModelBuilder", "ProgressFn", "StepLog", "TrainModel", "TrainOptions",
           "agree_on_errors", "build_tiny_model", "default_dtype", "run_training"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

ProgressFn = Callable[[str, int], AbstractContextManager[Callable[[], Any]]]
"""``progress(description, total)``: a context manager yielding ``advance()``, called after every step
(``flashcp.cli.console.progress`` draws a bar on an interactive terminal)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainOptions:
    """One training run."""

    data: str
    """Dataset folder."""
    plan: str
    """Plan name (a folder under ``DATA/plans``); its ``cp`` must equal the number of ranks."""
    steps: int
    """Total optimizer steps (``accum_steps`` packed sequences per replica each); a resumed run continues up to
    this number."""
    comm: str = "auto"
    """K/V exchange: ``allgather``, ``a2a``, ``full`` or ``auto``."""
    backend: str = "auto"
    """Attention kernels: ``fa3``, ``fa4``, ``flash_attn``, ``torch_varlen``, ``reference`` or ``auto``."""
    lr: float = 1e-3
    """AdamW base learning rate (the schedule's peak)."""
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    """Warm-up and decay of the learning rate, set before every optimizer step (default: constant ``lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    dtype: str | None = None
    """Parameter dtype: float32, float64 or bfloat16; None: bfloat16 on CUDA, float32 elsewhere."""
    model: str = "tiny"
    """The model's name, built by ``run_training``'s ``build_model``: ``tiny`` (flashcp.models.tiny), or with
    ``flashcp.integrations.models.build_model`` also a transformers architecture (``llama``, ``qwen2``) or a
    torchtitan decoder (``titan-llama3``, ``titan-qwen3``)."""
    vocab_size: int = 512
    """Model vocabulary; token ids are folded into it (``id % vocab_size``)."""
    dim: int = 64
    """Model width."""
    num_layers: int = 2
    """Decoder blocks."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads."""
    ckpt: str | None = None
    """Checkpoint file, written every ``save_every`` steps and at the end; None: no checkpoints."""
    resume: bool = False
    """Start from ``ckpt`` (which must exist)."""
    save_every: int = 0
    """Save every this many steps as well as at the end (0: only at the end)."""
    seed: int = 0
    """Initial weights and data order."""
    shuffle: bool = True
    """Shuffle the data order per epoch (else file order)."""
    dp: int = 1
    """Data-parallel replicas; the ranks launched must be ``dp`` times the plan's ``cp``."""
    sharding: str = "replicate"
    """``replicate`` (every rank holds the weights, gradients all-reduced) or ``fsdp`` (FSDP2 over dp x cp)."""
    prefetch: int = 2
    """Batches built ahead on a background thread (0: build each batch on the training thread)."""
    accum_steps: int = 1
    """Micro-batches (packed sequences) each replica trains per optimizer step: gradient accumulation."""
    max_grad_norm: float = 0.0
    """Clip the gradients to this global L2 norm before each update; 0: no clipping."""
    balance_window: int = 16
    """Steps per DP balance window (``CPLoader``): with ``dp`` > 1 each window's sequences are grouped into
    steps by cost; 0 keeps the stream order."""

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be at least 0, got {self.steps}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype '{self.dtype}' (choose from {', '.join(DTYPES)})")
        if self.resume and not self.ckpt:
            raise ValueError("--resume needs --ckpt, the checkpoint file to resume from")
        if self.save_every < 0:
            raise ValueError(f"save_every must be at least 0, got {self.save_every}")
        if self.dp < 1:
            raise ValueError(f"--dp must be at least 1, got {self.dp}")
        if self.sharding not in SHARDING_MODES:
            raise ValueError(f"unknown sharding '{self.sharding}' (choose from {', '.join(SHARDING_MODES)})")
        if self.prefetch < 0:
            raise ValueError(f"--prefetch must be at least 0, got {self.prefetch}")
        if self.accum_steps < 1:
            raise ValueError(f"--accum must be at least 1, got {self.accum_steps}")
        if self.max_grad_norm < 0:
            raise ValueError(f"--clip must be at least 0 (0: no clipping), got {self.max_grad_norm}")
        if self.balance_window < 0:
            raise ValueError(f"--balance-window must be at least 0, got {self.balance_window}")
        self.lr_schedule.check(self.steps)
        TinyConfig(vocab_size=self.vocab_size, dim=self.dim, num_layers=self.num_layers,
                   num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)  # validates the shape

    def identity(self) -> dict:
        """What a checkpoint must share with the run that resumes it."""
        keep = ("data", "plan", "dtype", "model", "vocab_size", "dim", "num_layers", "num_heads",
                "num_kv_heads", "seed", "shuffle")
        return {k: v for k, v in asdict(self).items() if k in keep}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLog:
    """One step as every rank saw it (the same on every rank)."""

    step: int
    """1-based step number."""
    loss: float
    """The sequence's mean loss."""
    num_tokens: int
    """Tokens of the global batch (``dp x accum_steps`` packed sequences)."""
    seconds: float
    """Rank 0's wall time for the step, data loading included (the ranks wait for each other in the step's
    collectives, so it is the slowest rank's time up to the local optimizer update)."""
    kv_bytes_busiest: int
    """Largest K/V bytes sent plus received by one rank (attention exchange, forward and backward)."""
    kv_bytes_total: int
    """K/V bytes sent, summed over ranks."""
    grad_bytes: int
    """Bytes of one rank's gradient all-reduce input."""
    grad_norm: float | None = None
    """Global gradient L2 norm before clipping (None without ``max_grad_norm``)."""
    lr: float | None = None
    """The learning rate the step's update used (None: not recorded)."""

    @property
    def tokens_per_s(self) -> float:
        """Packed-sequence tokens per second."""
        return self.num_tokens / self.seconds if self.seconds > 0 else float("inf")


def default_dtype(device: torch.device | str) -> str:
    """The parameter dtype a run on ``device`` uses when none is given: bfloat16 on CUDA, else float32."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class TrainModel:
    """A freshly built model and what training it needs (what a ``ModelBuilder`` returns)."""

    model: nn.Module
    """The model, on its device, every rank with the same weights (drawn from torch's RNG)."""
    loss_sum_fn: LossSumFn
    """Its summed loss over this rank's labels (``train_step``'s hook)."""
    fsdp: FsdpFn | None = None
    """How ``sharding="fsdp"`` wraps it (``shard_model``'s ``fsdp``); None: FSDP2 per decoder block."""
    spec: ModelSpec | None = None
    """The model as flashcp prices it: a stored plan priced for another model warns once
    (``CPLoader.check_model``); None: not checked."""


ModelBuilder = Callable[[TrainOptions, torch.device, int | None], TrainModel]
"""``build_model(options, device, context_len)``: the model ``options.model`` names, shaped by ``options``, in
the parameter dtype ``options.dtype`` on ``device``; ``context_len`` (the dataset's) may size a position cache.
Raises ValueError for a name it does not build."""


def build_tiny_model(options: TrainOptions, device: torch.device, context_len: int | None = None) -> TrainModel:
    """``run_training``'s default ``ModelBuilder``: ``tiny``, a ``TinyDecoder`` (FFN width ``2 * dim``).

    Raises ValueError for another ``options.model`` (``flashcp.integrations.models.build_model`` builds them all).
    """
    if options.model != "tiny":
        raise ValueError(f"model '{options.model}' needs its builder: pass "
                         "build_model=flashcp.integrations.models.build_model to run_training")
    dtype = DTYPES[options.dtype or default_dtype(device)]
    config = TinyConfig(vocab_size=options.vocab_size, dim=options.dim, num_layers=options.num_layers,
                        num_heads=options.num_heads, num_kv_heads=options.num_kv_heads, ffn_dim=2 * options.dim)
    spec = None if config.num_layers < 1 else ModelSpec(
        name="tiny", num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.dim // config.num_heads, hidden_size=config.dim, mlp_width=config.ffn_dim,
        vocab_size=config.vocab_size, layers=(LayerKind(),) * config.num_layers)
    return TrainModel(model=TinyDecoder(config).to(device, dtype), loss_sum_fn=tiny_loss_sum, spec=spec)


@dataclass(slots=True)
class _Run:
    """What set-up produced: the pieces every step uses."""

    loader: CPLoader
    model: nn.Module
    loss_sum_fn: LossSumFn
    optimizer: torch.optim.Optimizer
    start: int
    groups: ParallelGroups | None
    prefetch: int
    batches: Iterator[Batch] | None = None
    prefetcher: Prefetcher | None = None

    def next_batch(self) -> Batch:
        if self.batches is None:
            if self.prefetch:
                self.prefetcher = Prefetcher(self.loader, self.prefetch,
                                             pin_memory=torch.cuda.is_available())
                self.batches = self.prefetcher
            else:
                self.batches = self._epochs()
        return next(self.batches)

    def loader_state(self) -> Any:
        """What a checkpoint saves as the loader's state: after the last batch trained on."""
        return self.prefetcher if self.prefetcher is not None else self.loader

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _epochs(self) -> Iterator[Batch]:
        while True:  # epoch after epoch; the loader counts epochs itself
            yield from self.loader


def run_training(options: TrainOptions, *, group=None, device: torch.device | str = "cpu",
                 log: Callable[[str], None] | None = None, progress: ProgressFn | None = None,
                 build_model: ModelBuilder = build_tiny_model) -> list[StepLog]:
    """Train as this rank; returns the steps run (identical on every rank).

    Without data parallelism ``group`` is the CP group (None: the default group). With ``options.dp`` > 1
    or FSDP2 the whole world forms the ``(dp, cp)`` mesh (``group`` must be None). ``log`` receives the
    human-readable lines on rank 0 (None: silent); ``progress`` wraps the steps on rank 0 (None: no bar).
    ``build_model`` builds ``options.model`` (default: ``tiny`` only). Raises FlashcpError, on every rank
    alike, for bad input found while setting up (an unknown model name included).
    """
    device = torch.device(device)
    if options.dtype is None:
        options = replace(options, dtype=default_dtype(device))
    rank, world = group_rank(group), group_size(group)
    log = log if rank == 0 else None
    error: Exception | None = None
    run, groups = None, None
    on_mesh = options.dp > 1 or options.sharding == "fsdp"
    if on_mesh and not (dist.is_available() and dist.is_initialized()):
        error = FlashcpError(f"--dp {options.dp} with --sharding {options.sharding} needs a process group; "
                             "launch with torchrun")
    elif on_mesh and world % options.dp:
        error = FlashcpError(f"--dp {options.dp} does not divide the {world} ranks launched; launch dp x cp "
                             "ranks")
    elif on_mesh:
        groups = ParallelGroups.from_mesh(build_mesh(options.dp, world // options.dp, device.type))
    if error is None:
        try:
            run = _set_up(options, rank, world, device, groups, build_model)
        except (FlashcpError, ValueError) as e:
            error = e
    all_ranks = group if groups is None else groups.grad_group
    agree_on_errors(error, all_ranks)
    assert run is not None
    if log:
        layout = (f"dp {options.dp} x cp {world // options.dp} ({options.sharding})" if groups is not None
                  else f"{world} ranks")
        log(f"{options.model} model, {sum(p.numel() for p in run.model.parameters()):,} parameters "
            f"({options.dtype}); plan '{options.plan}' on {layout}, {run.loader.context_len} tokens per "
            f"sequence, comm {options.comm}; step {run.start} of {options.steps} done")
    logs: list[StepLog] = []
    todo = max(options.steps - run.start, 0)
    try:
        with (progress("training", todo) if progress is not None and rank == 0 else nullcontext(None)) as advance:
            for step in range(run.start + 1, options.steps + 1):
                logs.append(_step(options, step, run, group, device))
                if log:
                    log(_format(logs[-1], options.steps, show_lr=options.lr_schedule != LRSchedule()))
                if options.ckpt and (step == options.steps
                                     or (options.save_every and step % options.save_every == 0)):
                    save = save_sharded_checkpoint if options.sharding == "fsdp" else save_checkpoint
                    save(options.ckpt, step=step, model=run.model, optimizer=run.optimizer,
                         loader=run.loader_state(), config=options.identity(), group=all_ranks,
                         schedule=options.lr_schedule.record(options.lr, options.steps))
                    if log:
                        log(f"saved {options.ckpt} at step {step}")
                if advance is not None:
                    advance()
    finally:
        run.close()
    return logs


def _set_up(options: TrainOptions, rank: int, world: int, device: torch.device,
            groups: ParallelGroups | None, build_model: ModelBuilder) -> _Run:
    if options.ckpt:  # before any work: a path that is not a flashcp checkpoint is refused now
        check_checkpoint_target(options.ckpt, sharded=options.sharding == "fsdp")
    if groups is not None:
        loader = CPLoader.from_mesh(options.data, options.plan, groups.mesh, seed=options.seed,
                                    shuffle=options.shuffle, balance_window=options.balance_window)
    else:
        loader = CPLoader(options.data, options.plan, rank, world, seed=options.seed, shuffle=options.shuffle)
    if len(loader) == 0:
        raise FlashcpError(f"dataset {options.data} holds no sequences")
    torch.manual_seed(options.seed)  # the same initial weights on every rank
    built = build_model(options, device, loader.context_len)
    if built.spec is not None:
        loader.check_model(built.spec)
    model, loss_sum_fn = built.model, built.loss_sum_fn
    if groups is not None:
        model = shard_model(model, groups, options.sharding, fsdp=built.fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    start = 0
    if options.resume:
        assert options.ckpt is not None
        schedule = options.lr_schedule.record(options.lr, options.steps)
        if options.sharding == "fsdp":
            start = load_sharded_checkpoint(Path(options.ckpt), model=model, optimizer=optimizer, loader=loader,
                                            config=options.identity(), group=groups.grad_group if groups else None,
                                            schedule=schedule)
        else:
            start = load_checkpoint(Path(options.ckpt), model=model, optimizer=optimizer, loader=loader,
                                    config=options.identity(), map_location=device, schedule=schedule)
    return _Run(loader=loader, model=model, loss_sum_fn=loss_sum_fn, optimizer=optimizer, start=start,
                groups=groups, prefetch=options.prefetch)


def _step(options: TrainOptions, step: int, run: _Run, group, device: torch.device) -> StepLog:
    began = time.perf_counter()
    kv_bytes = DTYPES[options.dtype or default_dtype(device)].itemsize  # auto comm: the K/V dtype's rule
    batches = [fold_vocab(run.next_batch().to(device, non_blocking=run.prefetcher is not None, comm=options.comm,
                                              kv_bytes=kv_bytes), options.vocab_size)
               for _ in range(options.accum_steps)]
    lr = options.lr * options.lr_schedule.factor(step, options.steps)
    for param_group in run.optimizer.param_groups:  # a plain float: no host sync, and checkpointed with the state
        param_group["lr"] = lr
    result = train_step(run.model, run.optimizer, batches, run.loss_sum_fn, group=group, comm=options.comm,
                        backend=options.backend, groups=run.groups,
                        max_grad_norm=options.max_grad_norm or None)
    return StepLog(step=step, loss=result.loss,
                   num_tokens=run.loader.context_len * options.dp * options.accum_steps,
                   seconds=time.perf_counter() - began, kv_bytes_busiest=result.kv_bytes_busiest,
                   kv_bytes_total=result.kv_bytes_total, grad_bytes=result.grad_bytes, grad_norm=result.grad_norm,
                   lr=lr)


def _format(entry: StepLog, steps: int, show_lr: bool = False) -> str:
    width = len(str(steps))
    return (f"step {entry.step:>{width}}/{steps}  loss {entry.loss:.4f}  {entry.tokens_per_s:>9,.0f} tok/s  "
            f"K/V {_bytes(entry.kv_bytes_busiest)} busiest rank, {_bytes(entry.kv_bytes_total)} sent in all  "
            f"grads {_bytes(entry.grad_bytes)}" + ("" if entry.grad_norm is None else f", norm {entry.grad_norm:.3g}")
            + (f"  lr {entry.lr:.3g}" if show_lr and entry.lr is not None else ""))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
