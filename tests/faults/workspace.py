"""Helpers of the fault suite: a whole-tree fingerprint, a one-sentence check, and simulated faults."""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from click.testing import CliRunner

from flashcp.cli import cli

ROOT = Path(__file__).resolve().parents[2]
EOS = 256  # the byte tokenizer's


def run(*args):
    """Run ``flashcp ARGS`` in-process; stdout and stderr are kept apart."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): file sha256, ``dir``, or ``link -> target``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def one_sentence(result, *needles: str, code: int = 1) -> str:
    """Assert exit ``code``, exactly one line on stderr holding every needle, and no traceback."""
    err = result.stderr
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    assert err.endswith("\n") and err.count("\n") == 1, f"expected one line on stderr, got {err!r}"
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    return path


def docs(n: int, seed: int = 0) -> list[str]:
    words = ["alpha", "beta", "gamma", "delta", "zeta", "eta", "theta"]
    return [" ".join(words[(seed + i * 7 + j) % len(words)] for j in range(5 + (i * 13 + seed) % 40))
            for i in range(n)]


def pack_args(inputs, out, *extra, context_len: int = 64):
    inputs = inputs if isinstance(inputs, list | tuple) else [inputs]
    return ["pack", *inputs, "-o", out, "--context-len", context_len, "--tokenizer", "byte", "--workers", 1,
            "--rows-per-file", 4, "--row-group-rows", 2, *extra]


def packed_template(base: Path, num_docs: int, plans: list[tuple[int, str]]) -> Path:
    """``base`` with ``in.jsonl`` (``docs(num_docs)``) packed into ``base/data`` (``pack_args``: byte tokenizer,
    64-token sequences) and a plan ``--cp CP --strategy STRATEGY`` for each of ``plans``; every command must
    succeed."""
    src = write_jsonl(base / "in.jsonl", docs(num_docs))
    result = run(*pack_args(src, base / "data"))
    assert result.exit_code == 0, result.output
    for cp, strategy in plans:
        result = run("plan", base / "data", "--cp", cp, "--strategy", strategy)
        assert result.exit_code == 0, result.output
    return base


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


class ReadOnly:
    """Make every write, rename and delete under ``root`` fail with EACCES, as on a read-only folder.

    CI runs as root, which ignores file modes, so the failure is simulated at the os level: creating files
    and folders, opening for writing, renaming, removing and temporary files.
    """

    def __init__(self, monkeypatch, root: Path):
        self.root = str(Path(root).resolve())
        real_open, real = builtins.open, {name: getattr(os, name) for name in
                                          ("mkdir", "open", "rename", "replace", "unlink", "rmdir")}
        real_mkstemp = tempfile.mkstemp

        def denied(path):
            return OSError(errno.EACCES, "Permission denied", str(path))

        def inside(path) -> bool:
            try:
                return os.path.realpath(os.fsdecode(path)).startswith(self.root)
            except TypeError:
                return False

        def guard(name):
            def wrapper(*args, **kwargs):
                paths = args[:2] if name in ("rename", "replace") else args[:1]
                if name == "open" and not (args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                    paths = ()
                if any(inside(p) for p in paths):
                    raise denied(args[0])
                return real[name](*args, **kwargs)
            return wrapper

        def guarded_open(file, mode="r", *args, **kwargs):
            if isinstance(file, str | bytes | os.PathLike) and any(c in mode for c in "wax+") and inside(file):
                raise denied(file)
            return real_open(file, mode, *args, **kwargs)

        def guarded_mkstemp(*args, dir=None, **kwargs):
            if dir is not None and inside(dir):
                raise denied(dir)
            return real_mkstemp(*args, dir=dir, **kwargs)

        for name in real:
            monkeypatch.setattr(os, name, guard(name))
        monkeypatch.setattr(builtins, "open", guarded_open)
        monkeypatch.setattr(tempfile, "mkstemp", guarded_mkstemp)


def workspace(template: Path, tmp_path: Path, bystanders: dict[str, str]) -> Path:
    """A private copy of ``template`` at ``tmp_path/ws`` plus bystander files (relative path -> text)."""
    ws = copy_tree(template, tmp_path / "ws")
    for relative, text in bystanders.items():
        (ws / relative).parent.mkdir(parents=True, exist_ok=True)
        (ws / relative).write_text(text)
    return ws


def unchanged(ws: Path, command, *needles, code: int = 1) -> str:
    """Run ``command``; assert one sentence (exit ``code``) and the whole tree under ``ws`` byte-identical."""
    before = tree(ws)
    err = one_sentence(run(*command), *needles, code=code)
    assert tree(ws) == before
    return err
