"""Helpers of the pack tests that the Ray engine's tests share: file hashes, a packer that kills itself."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


KILLER = """
import os, signal, sys
from flashcp.data.dataset import DataFileWriter
original, calls = DataFileWriter.write, [0]
def write(self, table):
    original(self, table)
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT_GROUP"]):
        os.kill(os.getpid(), signal.SIGKILL)
DataFileWriter.write = write
from flashcp.cli import cli
cli(sys.argv[1:], prog_name="flashcp")
"""
