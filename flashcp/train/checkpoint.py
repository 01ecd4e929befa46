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

``--ckpt`` follows ``flashcp.outputs``: ``check_checkpoint_target`` (called before training starts) refuses a
path inside a dataset, a symlink, or anything there that is not a flashcp checkpoint of the run's kind (a
file, or a sharded checkpoint folder), and the staging and backup folders of a sharded save are marked and
deleted only with their marker. A save that fails (disk full) fails on every rank with one sentence.
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashcp.errors import FlashcpError
from flashcp.fileio import atomic_path, write_json_atomic
from flashcp.outputs import (
    OutputKind,
    check_output,
    check_removable,
    folder_json,
    make_marked_dir,
    mark_dir,
    remove_marked,
)
from flashcp.train.step import agree_on_errors, group_rank

__all__ = ["CHECKPOINT_FILE", "CHECKPOINT_FORMAT", "SHARDED_CHECKPOINT", "SHARDED_MARKER",
           "check_checkpoint_target", "check_sharded_target", "is_sharded_checkpoint", "load_checkpoint",
           "load_sharded_checkpoint", "save_checkpoint", "save_sharded_checkpoint"]

CHECKPOINT_FORMAT = 1
_KEYS = ("format", "step", "config", "model", "optimizer", "loader")


def _is_checkpoint_file(path: Path) -> bool:
    """True when ``path`` is a checkpoint ``save_checkpoint`` wrote (its tensors are mapped, not read)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - whatever it is, it is not a flashcp checkpoint
        return False
    return isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT and all(k in state for k in _KEYS)


CHECKPOINT_FILE = OutputKind(what="a flashcp checkpoint", option="--ckpt", recognise=_is_checkpoint_file)
"""``--ckpt`` of a run that saves one file."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _write_error(path: str | Path, write: Callable[[], None]) -> FlashcpError | None:
    """Call ``write``: None when it succeeds, else the FlashcpError for ``agree_on_errors`` to raise on every rank.

    An OSError becomes a FlashcpError naming the checkpoint ``path``.
    """
    try:
        write()
    except FlashcpError as e:
        return e
    except OSError as e:
        return FlashcpError(f"cannot write checkpoint {path}: {e.strerror or e}")
    return None


def save_checkpoint(path: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    loader: Any, config: dict, group=None, schedule: dict | None = None) -> None:
    """Write the checkpoint of a run that has done ``step`` steps; call on every rank of the CP ``group``.

    Rank 0 writes ``path`` atomically; every rank returns once the file is in place, or raises the same
    FlashcpError when it could not be written (the previous checkpoint then stays as it was). ``loader`` is
    anything with ``state_dict()`` (a ``CPLoader``); ``config`` a JSON-like dict that identifies the run (a
    resume must present the same); ``schedule`` the learning-rate schedule's record (``LRSchedule.record``),
    checked the same way on resume.
    """
    error: Exception | None = None
    if group_rank(group) == 0:
        state = {"format": CHECKPOINT_FORMAT, "step": int(step), "config": dict(config),
                 "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "loader": loader.state_dict()}
        if schedule is not None:
            state["schedule"] = dict(schedule)

        def write() -> None:
            check_output(path, CHECKPOINT_FILE)  # again: something may have appeared there while training
            with atomic_path(path) as tmp:
                torch.save(state, tmp)

        error = _write_error(path, write)
    agree_on_errors(error, group)  # also the barrier: every rank sees the file when this returns


def _check_config(path: Path, saved: dict, config: dict) -> None:
    differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} (now {config.get(k)!r})" for k in differ)
        raise FlashcpError(f"checkpoint {path} was made by a different run: {shown}; resume with the same "
                           "settings or start a new checkpoint")


def _check_schedule(path: Path, saved: dict | None, schedule: dict | None) -> None:
    # a checkpoint from before schedules were recorded trained at its optimizer's constant learning rate
    if saved is None or schedule is None or saved == schedule:
        return
    shown = ", ".join(f"{k} {saved.get(k)!r} (now {schedule.get(k)!r})" for k in sorted(set(saved) | set(schedule))
                      if saved.get(k) != schedule.get(k))
    raise FlashcpError(f"checkpoint {path} was trained with another learning-rate schedule: {shown}; resume with "
                       "the same --lr, --lr-schedule, --warmup-steps, --min-lr-ratio and --decay-steps")


def load_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                    config: dict, map_location: torch.device | str = "cpu", schedule: dict | None = None) -> int:
    """Restore model, optimizer and loader from ``path``; returns the number of steps already done.

    Raises FlashcpError (one sentence) for a missing or unreadable file, a checkpoint of another format, or
    one whose ``config`` or learning-rate ``schedule`` differs from this run's (naming the keys that differ).
    """
    path = Path(path)
    if not path.is_file():
        raise FlashcpError(f"checkpoint {path} does not exist; run without --resume to start from step 0")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise FlashcpError(f"checkpoint {path} cannot be read ({_first_line(e)}); delete it or point --ckpt "
                           "elsewhere") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise FlashcpError(f"checkpoint {path} has format {found}, this flashcp reads format "
                           f"{CHECKPOINT_FORMAT}")
    _check_config(path, state.get("config", {}), config)
    _check_schedule(path, state.get("schedule"), schedule)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    return int(state["step"])


SHARDED_MARKER = "flashcp.json"
"""The file that makes a folder a flashcp sharded checkpoint (step, config, loader state); written last."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True when ``path`` is a folder written by ``save_sharded_checkpoint`` (its ``flashcp.json`` is ours)."""
    meta = folder_json(Path(path), SHARDED_MARKER)
    return meta is not None and meta.get("format") == CHECKPOINT_FORMAT and "step" in meta and "loader" in meta


SHARDED_CHECKPOINT = OutputKind(what="a flashcp sharded checkpoint", option="--ckpt",
                                recognise=is_sharded_checkpoint, folder=True)
"""``--ckpt`` of an FSDP2 run: a ``torch.distributed.checkpoint`` folder."""


def _staging_paths(path: Path) -> tuple[Path, Path]:
    """The staging folder a sharded save builds in, and where the previous checkpoint waits during the swap."""
    return path.parent / f".{path.name}.staging", path.parent / f".{path.name}.old"


def check_checkpoint_target(path: str | Path, *, sharded: bool) -> None:
    """FlashcpError (one sentence) unless flashcp may save a checkpoint at ``path``; call before training.

    See ``flashcp.outputs``: no path inside a dataset or through a symlink, and whatever is at ``path`` must be
    a flashcp checkpoint of this kind (it is then replaced at the next save). For a sharded checkpoint, a
    ``.NAME.staging`` or ``.NAME.old`` folder beside it must be flashcp's (marked) or absent.
    """
    path = Path(path)
    check_output(path, SHARDED_CHECKPOINT if sharded else CHECKPOINT_FILE)
    if sharded:
        staging, old = _staging_paths(path)
        check_removable(staging, f"checkpoint {path}")
        check_removable(old, f"checkpoint {path}")


def check_sharded_target(path: str | Path) -> None:
    """Raise FlashcpError when ``path`` exists but is not a sharded checkpoint flashcp may replace."""
    check_checkpoint_target(path, sharded=True)


def save_sharded_checkpoint(path: str | Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            loader: Any, config: dict, group=None, schedule: dict | None = None) -> None:
    """Write a ``torch.distributed.checkpoint`` (DCP) folder; call on every rank of ``group`` (all ranks).

    Model and optimizer go through DCP (each rank writes its own shards: FSDP2 DTensors or replicated
    tensors alike), and rank 0 writes ``flashcp.json`` beside them: format, step, config, the learning-rate
    ``schedule`` (when given) and the loader state (the same on every rank, see ``CPLoader``). The folder is
    built under the staging name ``.NAME.staging`` next to ``path`` (marked as flashcp's when it is made) and
    swapped in at the end (the previous checkpoint, marked, moves to ``.NAME.old`` for the two renames and is
    deleted after), so a run killed while saving leaves the previous checkpoint intact, and
    ``load_sharded_checkpoint`` finds it. A DCP checkpoint can be loaded on another mesh shape (DCP reshards).
    A failed save raises the same FlashcpError on every rank.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path = Path(path)
    staging, old = _staging_paths(path)
    rank = group_rank(group)
    error: Exception | None = None
    try:
        check_checkpoint_target(path, sharded=True)  # on every rank: none is left waiting for one that refused
    except FlashcpError as e:
        error = e
    agree_on_errors(error, group)  # every rank has looked before rank 0 touches anything
    if rank == 0:
        error = _write_error(path, lambda: _make_staging(path, staging))
    agree_on_errors(error, group)
    # the model's own state_dict (FSDP2: its DTensor shards), so state_dict hooks that rename tensors (torchtitan's
    # fused QKV saves wq/wk/wv) apply; torch's get_state_dict maps every key back to a module attribute
    model_state, optim_state = model.state_dict(), get_optimizer_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging),
                 process_group=group)
    except Exception as e:  # noqa: BLE001 - DCP wraps every rank's OSError in its own exception, on every rank
        raise FlashcpError(f"cannot write checkpoint {path}: {_first_line(e)}") from None
    if rank == 0:
        def publish() -> None:
            meta = {"format": CHECKPOINT_FORMAT, "step": int(step), "config": dict(config),
                    "loader": loader.state_dict()}
            if schedule is not None:
                meta["schedule"] = dict(schedule)
            write_json_atomic(staging / SHARDED_MARKER, meta)
            if path.exists():
                remove_marked(old, f"checkpoint {path}")
                mark_dir(path, f"previous checkpoint {path.name}")  # so that its backup is provably ours
                os.replace(path, old)
            os.replace(staging, path)
            remove_marked(old, f"checkpoint {path}")

        error = _write_error(path, publish)
    agree_on_errors(error, group)


def _make_staging(path: Path, staging: Path) -> None:
    remove_marked(staging, f"checkpoint {path}")  # a previous save killed midway
    make_marked_dir(staging, f"staging folder of checkpoint {path.name}")


def _check_complete(path: Path) -> None:
    """FlashcpError (one sentence) when a DCP folder lacks its ``.metadata`` or any file it lists."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise FlashcpError(f"checkpoint {path} is incomplete: its .metadata file is missing; restore the folder "
                           "or start again without --resume")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - an unpickling error of any kind: the file is damaged
        raise FlashcpError(f"checkpoint {path} is damaged: its .metadata cannot be read ({_first_line(e)}); "
                           "restore the folder or start again without --resume") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        needed[name] = max(needed.get(name, 0), int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0)))
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise FlashcpError(f"checkpoint {path} is incomplete: its shard {name} is missing; restore the folder "
                               "or start again without --resume")
        if shard.stat().st_size < size:
            raise FlashcpError(f"checkpoint {path} is damaged: its shard {name} is shorter than its .metadata "
                               "records; restore the folder or start again without --resume")


def load_sharded_checkpoint(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
                            config: dict, group=None, schedule: dict | None = None) -> int:
    """Restore model, optimizer and loader from a ``save_sharded_checkpoint`` folder; returns the steps done.

    Call on every rank, after ``shard_model`` and building the optimizer. Raises FlashcpError (one sentence)
    for a missing folder, a folder that is not a flashcp sharded checkpoint, another run's checkpoint (its
    config or learning-rate schedule), or a checkpoint missing its ``.metadata`` or one of its shard files
    (checked before DCP reads anything).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(path)
    _, old = _staging_paths(path)
    if not path.exists() and is_sharded_checkpoint(old):  # killed between the two renames of a save
        path = old
    if not path.exists():
        raise FlashcpError(f"checkpoint {path} does not exist; run without --resume to start from step 0")
    if not is_sharded_checkpoint(path):
        raise FlashcpError(f"checkpoint folder {path} is not a flashcp sharded checkpoint (no readable "
                           f"{SHARDED_MARKER}); point --ckpt elsewhere")
    meta = json.loads((path / SHARDED_MARKER).read_text())
    _check_config(path, meta.get("config", {}), config)
    _check_schedule(path, meta.get("schedule"), schedule)
    _check_complete(path)
    # the model's own state_dict (FSDP2: its DTensor shards), so state_dict hooks that rename tensors (torchtitan's
    # fused QKV saves wq/wk/wv) apply; torch's get_state_dict maps every key back to a module attribute
    model_state, optim_state = model.state_dict(), get_optimizer_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=group)  # fills the tensors of ``state`` in place
    except Exception as e:  # noqa: BLE001 - DCP reports every rank's failure as its own exception, on every rank
        raise FlashcpError(f"checkpoint {path} cannot be read ({_first_line(e)}); restore it or start again "
                           "without --resume") from None
    model.load_state_dict(model_state)  # through the model's load hooks (torchtitan merges wq/wk/wv back)
    set_optimizer_state_dict(model, optimizer, optim_state)
    loader.load_state_dict(meta["loader"])
    return int(meta["step"])
