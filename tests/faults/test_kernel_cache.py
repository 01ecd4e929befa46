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
from flashcp.planner.planning import plan_sequence
from flashcp.planner.registry import Strategy, register
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


def cache_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.suffix in (".nbi", ".nbc"))


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_cache_entry_is_compiled_again(data, tmp_path, damage):
    """Case 10: truncated cache files (``UnpicklingError``) and empty ones (``EOFError``: click's bare
    ``Aborted!``) are ignored and compiled again, said once."""
    cache = tmp_path / "cache"
    plan = ["plan", data, "--cp", 4, "--strategy", "ring", "--compare", 0, "--force"]
    flashcp(plan, cache=cache)
    made = shards(data, "cp4-ring")
    for path in cache_files(cache):
        with open(path, "r+b") as f:
            f.truncate(0 if damage == "empty" else path.stat().st_size // 2)
    err = flashcp(plan, cache=cache).stderr
    assert err.count("warning:") == 1 and "is damaged" in err and "compiling again" in err, err
    assert shards(data, "cp4-ring") == made
    err = flashcp(plan, cache=cache).stderr  # compiled into the cache again
    assert "warning:" not in err and "compiling" not in err, err


FULL_DISK = """
import errno, sys
from numba.core import caching
def full(self, path):
    raise OSError(errno.ENOSPC, "No space left on device", path)
caching.IndexDataCacheFile._open_for_write = full  # every cache file numba writes
from flashcp.cli import cli
cli(sys.argv[1:], prog_name="flashcp")
"""


def test_a_full_kernel_cache_disk_plans_without_caching(data, tmp_path):
    """Case 11: the cache's disk is full: one warning naming the cache folder; the plan is made all the same."""
    cache = tmp_path / "cache"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run([sys.executable, "-c", FULL_DISK, "plan", str(data), "--cp", "4", "--strategy", "ring",
                           "--compare", "0"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    err = done.stderr
    assert done.returncode == 0 and "Traceback" not in err, err
    assert err.count("warning:") == 1 and f"cannot write the kernel cache in {cache}" in err, err
    assert "No space left on device" in err and str(data) not in err.split("warning:")[1].split("\n")[0]
    assert (data / "plans" / "cp4-ring" / "plan.json").is_file()
    assert not [path for path in cache_files(cache) if "planner" in path.parts]  # (synth's from the fixture)
