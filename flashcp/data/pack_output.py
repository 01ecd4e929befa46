"""The output folder of ``flashcp pack``: fresh start, resume, refusal, ``--force``, and clean-up.

While a pack runs, ``DATA/pack-state.json`` (written atomically after every finished data file) records the
pack's identity (a sha256 over the context length, tokenizer identity, options and inputs' content hashes)
and, for every finished data file, its hash and where packing stood after it. A re-run with the same identity
checks the finished files against their hashes and continues after the last good one; a re-run with another
identity is refused. ``manifest.json`` is written last; the state file is removed after it.

Only files that ``pack`` owns are ever removed: ``manifest.json``, ``pack-state.json``,
``data/part-*.parquet``, ``data/.part-*.tmp`` and, with ``--force``, ``plans/``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flashcp.data.dataset import DATA_DIR, MANIFEST_NAME, DataFile
from flashcp.errors import FlashcpError
from flashcp.fileio import sha256_file, write_json_atomic

__all__ = ["STATE_NAME", "OutputFolder", "PartRecord", "identity_from_manifest", "prepare_output"]

STATE_NAME = "pack-state.json"
STATE_FORMAT = "flashcp-pack-state"


@dataclass(frozen=True, kw_only=True, slots=True)
class PartRecord:
    """A finished data file and the packing position and counts right after its last row."""

    file: DataFile
    """The file's manifest entry."""
    resume: dict
    """``{"input", "record", "offset", "next_doc"}``: read on from record ``record`` of input ``input``, whose
    document is ``next_doc``, starting ``offset`` tokens into it."""
    snapshot: dict
    """The counters at that point (see ``flashcp.data.pack``)."""

    def to_json(self) -> dict:
        """The state file entry."""
        return {"file": self.file.to_json(), "resume": self.resume, "snapshot": self.snapshot}

    @staticmethod
    def from_json(entry: dict) -> PartRecord:
        """Inverse of ``to_json``."""
        return PartRecord(file=DataFile(**entry["file"]), resume=entry["resume"], snapshot=entry["snapshot"])


@dataclass(kw_only=True, slots=True)
class OutputFolder:
    """The output folder, prepared for a run."""

    root: Path
    """The dataset folder."""
    created: bool
    """True when this run created the folder (a failed run then removes it)."""
    parts: list[PartRecord]
    """Finished data files of an interrupted run with the same identity, verified; empty for a fresh start."""
    finished: dict | None = None
    """The manifest, when the folder already holds this very dataset (nothing left to do)."""

    def write_state(self, identity_sha256: str, identity: dict) -> None:
        """Record the finished parts (atomically)."""
        write_json_atomic(self.root / STATE_NAME, {"format": STATE_FORMAT, "identity_sha256": identity_sha256,
                                                   "identity": identity,
                                                   "parts": [p.to_json() for p in self.parts]})

    def remove_state(self) -> None:
        """Drop the state file once the manifest exists, and release the folder."""
        (self.root / STATE_NAME).unlink(missing_ok=True)
        self.release()

    def release(self) -> None:
        """Let other processes write to the folder again."""
        _unlock(self.root)

    def discard(self) -> None:
        """Remove everything this pack wrote (after a fatal error): no partial dataset is left behind."""
        _remove_pack_files(self.root, plans=False)
        self.release()
        if self.created:
            try:
                self.root.rmdir()
            except OSError:
                pass


def identity_from_manifest(manifest: dict) -> dict:
    """The pack identity a finished dataset was made with (as ``flashcp.data.pack`` builds it)."""
    options = {k: v for k, v in manifest.get("options", {}).items() if k != "identity_sha256"}
    inputs = [{k: entry.get(k) for k in ("path", "format", "bytes", "sha256")}
              for entry in manifest.get("inputs", [])]
    return {"context_len": manifest.get("context_len"), "tokenizer": manifest.get("tokenizer"),
            "options": options, "inputs": inputs}


def _difference(old: dict, new: dict) -> str:
    """The first way two identities differ, as a phrase."""
    if old.get("context_len") != new["context_len"]:
        return f"context length {old.get('context_len')} there, {new['context_len']} now"
    old_tok, new_tok = old.get("tokenizer") or {}, new["tokenizer"]
    if old_tok.get("name") != new_tok["name"]:
        return f"tokenizer {old_tok.get('name')} there, {new_tok['name']} now"
    if old_tok != new_tok:
        return f"tokenizer {new_tok['name']} has changed"
    old_options = old.get("options") or {}
    for key, value in new["options"].items():
        if old_options.get(key) != value:
            return f"{key} {old_options.get(key)!r} there, {value!r} now"
    old_inputs = old.get("inputs") or []
    if len(old_inputs) != len(new["inputs"]):
        return f"{len(old_inputs)} input files there, {len(new['inputs'])} now"
    for before, now in zip(old_inputs, new["inputs"]):
        if before != now:
            return f"input {now['path']} differs" if before.get("path") == now["path"] else \
                f"input {before.get('path')} there, {now['path']} now"
    return "the pack options differ"


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashcpError(f"{path} is not readable JSON ({e}); add --force to overwrite {what}") from None
    if not isinstance(value, dict):
        raise FlashcpError(f"{path} is not a JSON object; add --force to overwrite {what}")
    return value


def _remove_pack_files(root: Path, *, plans: bool) -> None:
    for name in (MANIFEST_NAME, STATE_NAME):
        (root / name).unlink(missing_ok=True)
    data = root / DATA_DIR
    if data.is_dir():
        for path in [*data.glob("part-*.parquet"), *data.glob(".part-*.tmp")]:
            path.unlink(missing_ok=True)
        try:
            data.rmdir()
        except OSError:
            pass  # holds files that are not ours
    if plans and (root / "plans").is_dir():
        shutil.rmtree(root / "plans")


def _check_writable(root: Path) -> bool:
    """Create ``root`` if needed and prove it writable; returns whether it was created."""
    if root.exists() and not root.is_dir():
        raise FlashcpError(f"output {root} exists and is not a folder")
    created = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".flashcp-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FlashcpError(f"cannot write to output folder {root}: {e.strerror or e}") from None
    return created


_locks: dict[Path, int] = {}  # folder -> open descriptor holding its lock, for the life of the process


def _lock(root: Path) -> None:
    """Hold an exclusive lock on the folder itself (no lock file is left behind), or refuse."""
    key = root.resolve()
    if key in _locks:
        return
    fd = os.open(key, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise FlashcpError(f"another flashcp pack is writing to {root}; wait for it to finish") from None
    _locks[key] = fd


def _unlock(root: Path) -> None:
    fd = _locks.pop(root.resolve(), None)
    if fd is not None:
        os.close(fd)


def _verified_parts(root: Path, parts: list[PartRecord]) -> list[PartRecord]:
    """The leading parts whose files still hash as recorded; the files after them are removed."""
    good: list[PartRecord] = []
    for part in parts:
        path = root / part.file.path
        if not path.is_file() or sha256_file(path) != part.file.sha256:
            break
        good.append(part)
    data = root / DATA_DIR
    keep = {root / p.file.path for p in good}
    if data.is_dir():
        for path in [*data.glob("part-*.parquet"), *data.glob(".part-*.tmp")]:
            if path not in keep:
                path.unlink()
    return good


def prepare_output(root: str | Path, identity_sha256: str, identity: dict, *, force: bool) -> OutputFolder:
    """Get the output folder ready for a pack with this identity.

    Fresh when the folder is new or empty (or with ``force``, after removing an earlier pack's files);
    resumed when it holds an interrupted pack with the same identity; ``finished`` when it already holds this
    dataset. Raises FlashcpError when it holds another dataset or pack, or anything else, or is not writable.
    """
    root = Path(root)
    created = _check_writable(root)
    _lock(root)
    try:
        return _prepare_locked(root, created, identity_sha256, identity, force=force)
    except BaseException:
        _unlock(root)
        raise


def _prepare_locked(root: Path, created: bool, identity_sha256: str, identity: dict, *,
                    force: bool) -> OutputFolder:
    if force:
        _remove_pack_files(root, plans=True)
        return OutputFolder(root=root, created=created, parts=[])
    manifest_path, state_path = root / MANIFEST_NAME, root / STATE_NAME
    if manifest_path.is_file():
        manifest = _read_json(manifest_path, "the dataset")
        if manifest.get("options", {}).get("identity_sha256") != identity_sha256:
            raise FlashcpError(f"{root} already holds a dataset packed with other inputs or options "
                               f"({_difference(identity_from_manifest(manifest), identity)}); choose another "
                               "folder or add --force to overwrite it")
        for entry in manifest.get("files", []):
            path = root / entry["path"]
            if not path.is_file() or sha256_file(path) != entry["sha256"]:
                raise FlashcpError(f"{root} holds this dataset but its data file {entry['path']} does not "
                                   "match the manifest; add --force to pack it again")
        (root / STATE_NAME).unlink(missing_ok=True)
        return OutputFolder(root=root, created=False, parts=[], finished=manifest)
    if state_path.is_file():
        state = _read_json(state_path, "the unfinished pack")
        if state.get("format") != STATE_FORMAT or state.get("identity_sha256") != identity_sha256:
            raise FlashcpError(f"{root} holds an unfinished pack with other inputs or options "
                               f"({_difference(state.get('identity') or {}, identity)}); re-run it with the "
                               "same ones to resume, or add --force to start over")
        try:
            parts = [PartRecord.from_json(entry) for entry in state.get("parts", [])]
        except (KeyError, TypeError):
            raise FlashcpError(f"{state_path} is damaged; add --force to start over") from None
        return OutputFolder(root=root, created=False, parts=_verified_parts(root, parts))
    if any(root.iterdir()):
        raise FlashcpError(f"output folder {root} is not empty and holds no flashcp dataset; choose a new or "
                           "empty folder, or add --force to write into it")
    return OutputFolder(root=root, created=created, parts=[])
