"""Training checkpoints: model, optimizer and loader state in one file, written atomically by one rank.

Under CP every rank holds the same weights and optimizer state (gradients are all-reduced before each
update) and its loader stands at the same place (all ranks walk the sequences in the same order), so rank 0
of the CP group writes one file and every rank reads it back. The file is written to a temporary name and
renamed (``flashcp.fileio.atomic_path``): a run killed while saving leaves the previous checkpoint intact.
Every rank waits for the write to finish before going on, so a resume right after a save sees the file.

Contents (``torch.save``, loaded with ``weights_only=True``)::

    {"format": 1, "step": steps done, "config": the run's identity (model shape, plan, dtype, ...),
     "model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}

With FSDP2 (``flashcp.train.parallel``) no rank holds the whole model: ``save_sharded_checkpoint`` writes a
``torch.distributed.checkpoint`` folder instead (every rank its shards), with the same step, config and
loader state in ``flashcp.json`` beside them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashcp.errors import FlashcpError
from flashcp.fileio import atomic_path
from flashcp.train.step import group_rank, group_size

__all__ = ["CHECKPOINT_FORMAT", "SHARDED_MARKER", "check_sharded_target", "is_sharded_checkpoint",
           "load_checkpoint", "load_sharded_checkpoint", "save_checkpoint", "save_sharded_checkpoint"]

CHECKPOINT_FORMAT = 1


def save_checkpoint(path: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    loader: Any, config: dict, group=None) -> None:
    """Write the checkpoint of a run that has done ``step`` steps; call on every rank of the CP ``group``.

    Rank 0 writes ``path`` atomically; every rank returns once the file is in place. ``loader`` is anything
    with ``state_dict()`` (a ``CPLoader``); ``config`` a JSON-like dict that identifies the run (a resume
    must present the same).
    """
    if group_rank(group) == 0:
        state = {"format": CHECKPOINT_FORMAT, "step": int(step), "config": dict(config),
                 "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "loader": loader.state_dict()}
        with atomic_path(path) as tmp:
            torch.save(state, tmp)
    if group_size(group) > 1:
        dist.barrier(group=group)


def _check_config(path: Path, saved: dict, config: dict) -> None:
    differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} (now {config.get(k)!r})" for k in differ)
        raise FlashcpError(f"checkpoint {path} was made by a different run: {shown}; resume with the same "
                           "settings or start a new checkpoint")


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                    config: dict, map_location: torch.device | str = "cpu") -> int:
    """Restore model, optimizer and loader from ``path``; returns the number of steps already done.

    Raises FlashcpError (one sentence) for a missing or unreadable file, a checkpoint of another format, or
    one whose ``config`` differs from this run's (naming the keys that differ).
    """
    path = Path(path)
    if not path.is_file():
        raise FlashcpError(f"checkpoint {path} does not exist; run without --resume to start from step 0")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FlashcpError(f"checkpoint {path} cannot be read ({first_line}); delete it or point --ckpt "
                           "elsewhere") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise FlashcpError(f"checkpoint {path} has format {found}, this flashcp reads format "
                           f"{CHECKPOINT_FORMAT}")
    _check_config(path, state.get("config", {}), config)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    return int(state["step"])


SHARDED_MARKER = "flashcp.json"
"""The file that makes a folder a flashcp sharded checkpoint (step, config, loader state); written last."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a folder written by ``save_sharded_checkpoint``."""
    return (Path(path) / SHARDED_MARKER).is_file()


def check_sharded_target(path: str | Path) -> None:
    """Raise FlashcpError when ``path`` exists but is not a sharded checkpoint flashcp may replace."""
    path = Path(path)
    if path.exists() and not is_sharded_checkpoint(path):
        raise FlashcpError(f"checkpoint folder {path} exists and is not a flashcp sharded checkpoint (no "
                           f"{SHARDED_MARKER}); point --ckpt elsewhere")


def save_sharded_checkpoint(path: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            loader: Any, config: dict, group=None) -> None:
    """Write a ``torch.distributed.checkpoint`` (DCP) folder; call on every rank of ``group`` (all ranks).

    Model and optimizer go through DCP (each rank writes its own shards: FSDP2 DTensors or replicated
    tensors alike), and rank 0 writes ``flashcp.json`` beside them: format, step, config and the loader
    state (the same on every rank, see ``CPLoader``). The folder is built under a staging name next to
    ``path`` and swapped in at the end (the previous checkpoint moves to ``.NAME.old`` for the two renames
    and is deleted after), so a run killed while saving leaves the previous checkpoint intact, and
    ``load_sharded_checkpoint`` finds it. A DCP checkpoint can be loaded on another mesh shape (DCP reshards).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = Path(path)
    staging = path.parent / f".{path.name}.staging"
    rank = group_rank(group)
    check_sharded_target(path)  # on every rank: none is left waiting for a rank that refused
    if rank == 0:
        if staging.exists():  # a previous save killed midway: the staging folder is flashcp's own
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    if group_size(group) > 1:
        dist.barrier(group=group)
    # the model's own state_dict (FSDP2: its DTensor shards), so state_dict hooks that rename tensors (torchtitan's
    # fused QKV saves wq/wk/wv) apply; torch's get_state_dict maps every key back to a module attribute
    model_state, optim_state = model.state_dict(), get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging), process_group=group)
    if rank == 0:
        from flashcp.fileio import write_json_atomic

        write_json_atomic(staging / SHARDED_MARKER, {"format": CHECKPOINT_FORMAT, "step": int(step),
                                                     "config": dict(config), "loader": loader.state_dict()})
        old = path.parent / f".{path.name}.old"
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(staging, path)
        if old.exists():
            shutil.rmtree(old)
    if group_size(group) > 1:
        dist.barrier(group=group)


def load_sharded_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                            config: dict, group=None) -> int:
    """Restore model, optimizer and loader from a ``save_sharded_checkpoint`` folder; returns the steps done.

    Call on every rank, after ``shard_model`` and building the optimizer. Raises FlashcpError (one sentence)
    for a missing folder, a folder that is not a flashcp sharded checkpoint, or another run's checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(path)
    old = path.parent / f".{path.name}.old"
    if not path.exists() and is_sharded_checkpoint(old):  # killed between the two renames of a save
        path = old
    if not path.exists():
        raise FlashcpError(f"checkpoint {path} does not exist; run without --resume to start from step 0")
    check_sharded_target(path)
    try:
        meta = json.loads((path / SHARDED_MARKER).read_text())
    except (OSError, ValueError) as e:
        raise FlashcpError(f"checkpoint {path} cannot be read ({e}); delete it or point --ckpt elsewhere") from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise FlashcpError(f"checkpoint {path} has format {meta.get('format')}, this flashcp reads format "
                           f"{CHECKPOINT_FORMAT}")
    _check_config(path, meta.get("config", {}), config)
    model_state, optim_state = model.state_dict(), get_optimizer_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(path), process_group=group)  # fills the tensors of ``state`` in place
    model.load_state_dict(model_state)  # through the model's load hooks (torchtitan merges wq/wk/wv back)
    set_optimizer_state_dict(model, optimizer, optim_state)
    loader.load_state_dict(meta["loader"])
    return int(meta["step"])
