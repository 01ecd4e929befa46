"""The output folder of ``flashcp pack``: fresh start, resume, refusal, ``--force``, and clean-up.

While a pack runs, ``DATA/pack-state.json`` (written atomically after every finished data file) records the
pack's identity (a sha256 over the context length, tokenizer identity, options and inputs' content hashes)
and, for every finished data file, its hash and where packing stood after it. A re-run with the same identity
checks the finished files against their hashes and continues after the last good one; a re-run with another
identity is refused. ``manifest.json`` is written last; the state file is removed after it.

Only files that ``pack`` owns are ever removed: ``manifest.json``, ``pack-state.json``,
``data/part-*.parquet``, ``data/.part-*.tmp`` and, with ``--force``, the old dataset's ``plans/``.

``--force`` over an existing dataset (or unfinished pack) builds the new one beside it, in the hidden folder
``DATA/.flashcp-replacement``, and swaps at the end: the old ``manifest.json``, ``pack-state.json``,
``data/`` and ``plans/`` move into ``DATA/.flashcp-replaced``, the new ``data/`` and ``manifest.json`` move
in (the manifest last), and the old ones are removed. A failure before the swap leaves the old dataset
byte-identical; a failure during it is rolled back; a kill during it is finished or rolled back by the next
``pack`` of that folder, and a kill before it leaves the replacement to be resumed by re-running the command.
``--force`` refuses a folder whose ``manifest.json`` is not flashcp's, whose dataset folders hold anything
flashcp did not make, or where any of these names is a symlink. The two hidden folders carry flashcp's marker
(``flashcp.outputs.MARKER_NAME``) from the moment they are made, and are deleted only when they are flashcp's
(marked, empty, or holding nothing but a dataset's own names); a folder of either name that is not is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flashcp.data.dataset import DATA_DIR, MANIFEST_NAME, REPLACE_OLD_DIR, DataFile
from flashcp.errors import FlashcpError
from flashcp.fileio import refuse_symlink, sha256_file, write_json_atomic
from flashcp.outputs import MARKER_NAME, enclosing_dataset, is_marked, make_marked_dir

__all__ = ["STATE_NAME", "OutputFolder", "PartRecord", "identity_from_manifest", "prepare_output"]

STATE_NAME = "pack-state.json"
STATE_FORMAT = "flashcp-pack-state"
PLANS_DIR = "plans"
REPLACE_NEW_DIR = ".flashcp-replacement"
"""Where ``pack --force`` builds the new dataset inside the old one's folder."""

_DATA_FILE = re.compile(r"part-\d{5}\.parquet|\.part-\d{5}\.parquet\..+\.tmp")
# the names flashcp.planner.plan_writer writes in a plan folder, and beside them in plans/
_PLAN_FILE = re.compile(r"plan\.json|part-\d{5}\.parquet|\.(plan\.json|part-\d{5}\.parquet)\..+\.tmp")
_PLANS_LOCK = re.compile(r"\..+\.lock")


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
    target: Path | None = None
    """With ``--force`` over an existing dataset: the dataset folder, while ``root`` is the replacement
    being built inside it; ``complete`` swaps them."""
    notes: list[str] = field(default_factory=list)
    """What the preparation found and did that the user should hear of."""
    resumed: bool = False
    """This run goes on from an interrupted one's finished files (a failure keeps them for the next run)."""
    identity: tuple[str, dict] | None = None
    """``(identity_sha256, identity)`` of the state file, once written."""
    kept: int = field(init=False, default=0)
    """Parts of ``parts`` kept from an interrupted run (the rest are this run's)."""

    def __post_init__(self):
        self.kept = len(self.parts)

    def write_state(self, identity_sha256: str, identity: dict) -> None:
        """Record the finished parts (atomically)."""
        self.identity = (identity_sha256, identity)
        write_json_atomic(self.root / STATE_NAME, {"format": STATE_FORMAT, "identity_sha256": identity_sha256,
                                                   "identity": identity,
                                                   "parts": [p.to_json() for p in self.parts]})

    def forget_parts_from(self, input_index: int) -> None:
        """Drop the parts this run finished that may hold documents of input ``input_index`` or later (it changed).

        Parts kept from an interrupted run were read from the content the identity records, and stay.
        """
        def clean(i: int, part: PartRecord) -> bool:
            at = part.resume
            return i < self.kept or at["input"] < input_index or (at["input"] == input_index and at["record"] == 0
                                                                   and at["offset"] == 0)

        keep = [p for i, p in enumerate(self.parts) if clean(i, p)]
        if len(keep) == len(self.parts):
            return
        for part in self.parts[len(keep):]:
            (self.root / part.file.path).unlink(missing_ok=True)
        self.parts = keep
        if self.identity is not None:
            self.write_state(*self.identity)

    def remove_state(self) -> None:
        """Drop the state file once the manifest exists, and release the folder."""
        (self.root / STATE_NAME).unlink(missing_ok=True)
        self.release()

    def complete(self) -> None:
        """After the manifest is written: drop the state file, swap a replacement into place, release."""
        try:
            (self.root / STATE_NAME).unlink(missing_ok=True)
            if self.target is not None:
                _swap(self.target, self.root)
                self.root, self.target = self.target, None
        finally:
            self.release()

    def release(self) -> None:
        """Let other processes write to the folder again."""
        _unlock(self.target or self.root)

    def discard(self) -> None:
        """Remove everything this pack wrote (after a fatal error): no partial dataset is left behind.

        A replacement is removed whole and the old dataset stays as it was; a fresh pack's files are removed
        (and its folder, when this run made it); a resumed pack keeps its finished files for the next run.
        """
        if self.target is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        elif not self.resumed:
            _remove_pack_files(self.root, plans=False)
            if self.created:
                try:
                    self.root.rmdir()
                except OSError:
                    pass
        self.release()


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
        raise FlashcpError(f"{path} is not readable JSON ({e}); flashcp will not overwrite {what} it cannot "
                           "recognise as its own: move it away or choose another folder") from None
    if not isinstance(value, dict):
        raise FlashcpError(f"{path} is not a JSON object; flashcp will not overwrite {what} it cannot "
                           "recognise as its own: move it away or choose another folder")
    return value


def _foreign_entry(root: Path) -> Path | None:
    """The first entry of the dataset's ``data/`` and ``plans/`` that flashcp did not make (None if none)."""
    data = root / DATA_DIR
    for folder in (data, root / PLANS_DIR):
        if folder.exists() and not folder.is_dir():
            return folder
    if data.exists():
        for entry in data.iterdir():
            if entry.is_symlink() or not entry.is_file() or not _DATA_FILE.fullmatch(entry.name):
                return entry
    plans = root / PLANS_DIR
    if plans.exists():
        for folder in plans.iterdir():
            if not folder.is_symlink() and folder.is_file() and _PLANS_LOCK.fullmatch(folder.name):
                continue
            if folder.is_symlink() or not folder.is_dir():
                return folder
            for entry in folder.iterdir():
                if entry.is_symlink() or not entry.is_file() or not _PLAN_FILE.fullmatch(entry.name):
                    return entry
    return None


_OWN_NAMES = frozenset((MANIFEST_NAME, STATE_NAME, DATA_DIR, PLANS_DIR, MARKER_NAME))


def _own_folder(folder: Path) -> bool:
    """True when ``folder`` (a replacement or replaced dataset) is provably flashcp's.

    Marked, or holding only a dataset's own names (as one made before the marker existed does).
    """
    if folder.is_symlink() or not folder.is_dir():
        return False
    if is_marked(folder):
        return True
    return all(entry.name in _OWN_NAMES for entry in folder.iterdir()) and _foreign_entry(folder) is None


def _refuse_foreign(folder: Path) -> None:
    if folder.exists() and not _own_folder(folder):
        raise FlashcpError(f"{folder} was not made by flashcp (no {MARKER_NAME} inside, and it holds other "
                           "files); flashcp deletes only its own folders: move it away and re-run")


def _swap(root: Path, staging: Path) -> None:
    """Move the finished dataset in ``staging`` into ``root`` and remove the old one (see the module doc)."""
    old = root / REPLACE_OLD_DIR
    make_marked_dir(old, f"old dataset of {root.name}, being replaced")
    moved: list[str] = []
    try:
        # the manifest first: the old dataset stops existing before any of its files moves
        for name in (MANIFEST_NAME, STATE_NAME, DATA_DIR, PLANS_DIR):
            if (root / name).exists():
                os.replace(root / name, old / name)
                moved.append(name)
        os.replace(staging / DATA_DIR, root / DATA_DIR)
        os.replace(staging / MANIFEST_NAME, root / MANIFEST_NAME)  # the new dataset exists from here
    except BaseException:
        if (root / DATA_DIR).exists() and not (staging / DATA_DIR).exists():
            os.replace(root / DATA_DIR, staging / DATA_DIR)
        for name in reversed(moved):
            os.replace(old / name, root / name)
        (old / MARKER_NAME).unlink(missing_ok=True)
        old.rmdir()
        raise
    shutil.rmtree(old)
    shutil.rmtree(staging)


def _recover_swap(root: Path) -> str | None:
    """Finish or roll back a swap that a kill interrupted; returns what was done."""
    old, staging = root / REPLACE_OLD_DIR, root / REPLACE_NEW_DIR
    if not old.is_dir() or old.is_symlink():
        return None
    _refuse_foreign(old)
    if (root / MANIFEST_NAME).exists() and (old / MANIFEST_NAME).exists():
        shutil.rmtree(old)
        if staging.is_dir() and not staging.is_symlink():
            _refuse_foreign(staging)
            shutil.rmtree(staging)
        return "finished replacing the dataset, which an interrupted 'pack --force' had swapped in"
    if (root / DATA_DIR).exists() and staging.is_dir() and not (staging / DATA_DIR).exists():
        os.replace(root / DATA_DIR, staging / DATA_DIR)
    for entry in old.iterdir():
        if entry.name != MARKER_NAME:
            os.replace(entry, root / entry.name)
    (old / MARKER_NAME).unlink(missing_ok=True)
    old.rmdir()
    return "put back the dataset that an interrupted 'pack --force' was replacing"


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

    Fresh when the folder is new or empty (or, with ``force``, holds none of flashcp's names); resumed when
    it holds an interrupted pack with the same identity; ``finished`` when it already holds this dataset;
    with ``force`` over a dataset or unfinished pack, a replacement built inside it and swapped in by
    ``complete``. Raises FlashcpError when it holds another dataset or pack (without ``force``), anything
    flashcp did not make where it would write or delete, a symlink in those places, or is not writable.
    """
    root = Path(root)
    inside = enclosing_dataset(root.parent)
    if inside is not None:
        raise FlashcpError(f"output folder {root} lies inside the dataset {inside}; choose a folder outside it")
    created = _check_writable(root)
    _lock(root)
    try:
        note = _recover_swap(root)
        out = _prepare_locked(root, created, identity_sha256, identity, force=force)
        if note:
            out.notes.insert(0, note)
        return out
    except BaseException:
        _unlock(root)
        raise


def _prepare_locked(root: Path, created: bool, identity_sha256: str, identity: dict, *,
                    force: bool) -> OutputFolder:
    for name in (MANIFEST_NAME, STATE_NAME, DATA_DIR, PLANS_DIR, REPLACE_NEW_DIR):
        refuse_symlink(root / name, root)
    manifest_path, state_path = root / MANIFEST_NAME, root / STATE_NAME
    manifest = _read_json(manifest_path, "a manifest.json") if manifest_path.exists() else None
    if manifest is not None and manifest.get("format") != "flashcp-dataset":
        raise FlashcpError(f"{manifest_path} is not a flashcp dataset manifest; flashcp will not overwrite a "
                           "folder it did not make: move it away or choose another folder")
    state = _read_json(state_path, "a pack-state.json") if state_path.exists() and manifest is None else None
    if state is not None and state.get("format") != STATE_FORMAT:
        raise FlashcpError(f"{state_path} is not a flashcp pack state; flashcp will not overwrite a folder it "
                           "did not make: move it away or choose another folder")
    notes = []
    if (root / REPLACE_NEW_DIR).exists() and not force:
        notes.append(f"{root / REPLACE_NEW_DIR} holds an unfinished replacement from an interrupted "
                     "'pack --force'; re-run that command to finish it")
    if force and (manifest is not None or state is not None):
        foreign = _foreign_entry(root)
        if foreign is not None and foreign.is_symlink():
            refuse_symlink(foreign, root)
        if foreign is not None:
            raise FlashcpError(f"{foreign} was not made by flashcp; --force replaces only flashcp's own files: "
                               "move it out of the dataset and re-run")
        out = _prepare_replacement(root, identity_sha256, identity)
        out.notes[:0] = notes
        return out
    if manifest is not None:
        try:
            _check_finished(root, manifest, identity_sha256, identity)
        except (KeyError, TypeError, AttributeError):
            raise FlashcpError(f"{manifest_path} is damaged; add --force to pack the dataset again") from None
        (root / STATE_NAME).unlink(missing_ok=True)
        return OutputFolder(root=root, created=False, parts=[], finished=manifest, notes=notes)
    if state is not None:
        parts = _resume_parts(root, state, identity_sha256, identity)
        return OutputFolder(root=root, created=False, parts=parts, notes=notes, resumed=bool(parts))
    if force:
        for name in (DATA_DIR, PLANS_DIR):
            if (root / name).exists():
                raise FlashcpError(f"{root / name} exists but {root} holds no flashcp dataset; flashcp will not "
                                   "write into or delete what it did not make: move it away or choose another "
                                   "folder")
    elif any(root.iterdir()):
        raise FlashcpError(f"output folder {root} is not empty and holds no flashcp dataset; choose a new or "
                           "empty folder, or add --force to write into it")
    return OutputFolder(root=root, created=created, parts=[], notes=notes)


def _check_finished(root: Path, manifest: dict, identity_sha256: str, identity: dict) -> None:
    """FlashcpError unless ``root`` holds the very dataset of this identity, every file as recorded."""
    if manifest.get("options", {}).get("identity_sha256") != identity_sha256:
        raise FlashcpError(f"{root} already holds a dataset packed with other inputs or options "
                           f"({_difference(identity_from_manifest(manifest), identity)}); choose another "
                           "folder or add --force to overwrite it")
    for entry in manifest.get("files", []):
        path = root / entry["path"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            raise FlashcpError(f"{root} holds this dataset but its data file {entry['path']} does not "
                               "match the manifest; add --force to pack it again")


def _resume_parts(root: Path, state: dict, identity_sha256: str, identity: dict) -> list[PartRecord]:
    if state.get("identity_sha256") != identity_sha256:
        raise FlashcpError(f"{root} holds an unfinished pack with other inputs or options "
                           f"({_difference(state.get('identity') or {}, identity)}); re-run it with the "
                           "same ones to resume, or add --force to start over")
    try:
        parts = [PartRecord.from_json(entry) for entry in state.get("parts", [])]
    except (KeyError, TypeError, AttributeError):
        raise FlashcpError(f"{root / STATE_NAME} is damaged; add --force to start over") from None
    foreign = _foreign_entry(root)
    if foreign is not None and foreign.is_relative_to(root / DATA_DIR):
        raise FlashcpError(f"{foreign} was not made by flashcp; move it out of {root / DATA_DIR} and re-run")
    return _verified_parts(root, parts)


def _prepare_replacement(root: Path, identity_sha256: str, identity: dict) -> OutputFolder:
    """A replacement for the dataset in ``root``, built in ``root/.flashcp-replacement``."""
    staging = root / REPLACE_NEW_DIR
    parts: list[PartRecord] = []
    _refuse_foreign(staging)
    if staging.exists():  # left by a killed 'pack --force': go on with it if it is this very pack
        manifest = _json_or_none(staging / MANIFEST_NAME)
        state = _json_or_none(staging / STATE_NAME)
        options = manifest.get("options") if manifest is not None else None
        if isinstance(options, dict) and options.get("identity_sha256") == identity_sha256:
            _swap(root, staging)
            return OutputFolder(root=root, created=False, parts=[], finished=manifest,
                                notes=["finished the replacement that an interrupted 'pack --force' had built"])
        if manifest is None and state is not None and state.get("identity_sha256") == identity_sha256 \
                and _foreign_entry(staging) is None:
            try:
                parts = _resume_parts(staging, state, identity_sha256, identity)
            except FlashcpError:
                parts = []
        if not parts:
            shutil.rmtree(staging)
    if not staging.exists():
        make_marked_dir(staging, f"replacement of dataset {root.name}, being built")
    return OutputFolder(root=staging, created=True, parts=parts, target=root)


def _json_or_none(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None
