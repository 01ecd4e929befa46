"""The fault suite, kernel cache: stale machine code, strategies registered at run time, damaged and full caches.

Each case runs flashcp in processes of its own over a cache folder of its own (``NUMBA_CACHE_DIR``), as a
user's successive commands do: what one process cached is what the next one loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.faults.workspace import ROOT

SHARDS = ["shard_doc", "shard_start", "shard_len", "shard_rank"]


def flashcp(args, *, cache: Path, source: Path = ROOT, code: int = 0) -> subprocess.CompletedProcess:
    """``python -m flashcp ARGS`` in a new process importing flashcp from ``source``, caching into ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(source)}
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-m", "flashcp", *map(str, args)], env=env, cwd=source,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr
    return done


def python(code: str, *, cache: Path) -> str:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def shards(data: Path, plan: str) -> dict:
    table = pq.read_table(data / "plans" / plan / "part-00000.parquet", columns=SHARDS)
    return table.to_pydict()


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    flashcp(["synth", root, "--dist", "wlb", "--num-seqs", 4, "--context-len", 4096, "--no-tokens"],
            cache=tmp_path / "cache")
    return root


def test_an_edited_registry_is_not_served_from_the_cache(data, tmp_path):
    """Case 1: the registry decides which kernel ``ring`` links; editing it must not load the old code."""
    source = tmp_path / "src"
    shutil.copytree(ROOT / "flashcp", source / "flashcp", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    plan = ["plan", data, "--cp", 4, "--strategy", "ring", "--compare", 0]
    flashcp(plan, cache=cache, source=source)
    ring = shards(data, "cp4-ring")
    registry = source / "flashcp" / "planner" / "registry.py"
    text = registry.read_text()
    assert text.count("kernel=ring_kernel") == 1
    registry.write_text(text.replace("kernel=ring_kernel", "kernel=llama3_kernel"))
    flashcp([*plan, "--force"], cache=cache, source=source)
    flashcp(["plan", data, "--cp", 4, "--strategy", "llama3", "--compare", 0], cache=cache, source=source)
    assert shards(data, "cp4-ring") == shards(data, "cp4-llama3") != ring


REGISTER = """
import json, sys
from flashcp.planner.registry import Strategy, plan_sequence, register
from flashcp.planner.strategies import baselines
register(Strategy(name="mine", defaults={{}}, kernel=baselines.{kernel}, description="mine"))
lens = [900, 50, 3000, 146]
mine, own = plan_sequence("mine", lens, 4), plan_sequence("{name}", lens, 4)
print(json.dumps([[p.shard_doc.tolist(), p.shard_start.tolist(), p.shard_rank.tolist()] for p in (mine, own)]))
"""


def test_a_registered_name_runs_the_kernel_it_was_registered_with(tmp_path):
    """Case 2: "mine" registered with ring's kernel, then in a later process with llama3's."""
    cache = tmp_path / "cache"
    mine, ring = json.loads(python(REGISTER.format(kernel="ring_kernel", name="ring"), cache=cache))
    assert mine == ring
    mine, llama3 = json.loads(python(REGISTER.format(kernel="llama3_kernel", name="llama3"), cache=cache))
    assert mine == llama3 != ring
