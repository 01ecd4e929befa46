"""Training checkpoints: model, optimizer and loader state in one file, written atomically by one rank.

Under CP every rank holds the same weights and optimizer state (gradients are all-reduced before each
update) and its loader stands at the same place (all ranks walk the sequences in the same order), so rank 0
of the CP group writes one file and every rank reads it back. The file is written to a temporary name and
renamed (``flashcp.fileio.atomic_path``): a run killed while saving leaves the previous checkpoint intact.
Every rank waits for the write to finish before going on, so a resume right after a save sees the file.

Contents (``torch.save``, loaded with ``weights_only=True``)::

    {"format": 1, "step": steps done, "config": the run's identity (model shape, plan, dtype, ...),
     "model": model.state_dict(), "optimizer": optimizer.state_dict(), "loader": loader.state_dict()}
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashcp.errors import FlashcpError
from flashcp.fileio import atomic_path
from flashcp.train.step import group_rank, group_size

__all__ = ["CHECKPOINT_FORMAT", "load_checkpoint", "save_checkpoint"]

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
    saved = state.get("config", {})
    differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} (now {config.get(k)!r})" for k in differ)
        raise FlashcpError(f"checkpoint {path} was made by a different run: {shown}; resume with the same "
                           "settings or start a new checkpoint")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    return int(state["step"])
