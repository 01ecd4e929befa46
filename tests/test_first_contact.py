"""First contact: the README's main job from an empty Numba cache, every command in a process of its own.

A suite that compiles the planner's kernels in one process cannot see what a second process loads from the
on-disk cache: machine code cached by ``plan --strategy flashcp`` once made the next ``plan`` (flashcp2)
reject every plan it made (``flashcp._numba`` says why). These tests run flashcp as a new user does: each
command a fresh process, the cache empty before the first. Every plan of every step is validated by the
command itself and again by ``verify``. ``bench/cache_pairs.py`` runs every ordered pair of strategies the
same way (too long for CI).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONTEXT_LEN = 8192
"""The tests' context length (the README's is 131072; the kernels compiled are the same)."""


def readme_main_job() -> list[list[str]]:
    """The ``flashcp`` commands of the README's main-job line, in their order, as argument lists."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^pip install -c constraints-cpu\.txt -e \. && (.+)$", text, re.M)
    assert match, "the README's main-job line is gone"
    steps = [shlex.split(part) for part in match.group(1).split(" && ")]
    return [step[1:] for step in steps if step[0] == "flashcp"]


def small_corpus(folder: Path) -> Path:
    """A few packages of the standard library's own source (the README packs all of it)."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    for package in ("json", "email", "http"):
        shutil.copytree(stdlib / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def fresh_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    env.pop("NUMBA_DISABLE_JIT", None)
    return env


def flashcp(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "flashcp", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"flashcp {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


def test_the_readme_main_job_runs_from_an_empty_cache(tmp_path):
    steps = readme_main_job()
    assert [s[0] for s in steps] == ["pack", "plan", "plan", "verify", "show", "bench"]
    corpus = small_corpus(tmp_path / "corpus")
    env = fresh_env(tmp_path / "numba-cache")
    outputs = []
    for step in steps:
        args = [str(corpus) if a == "$S" else a for a in step]
        if "--context-len" in args:
            args[args.index("--context-len") + 1] = str(CONTEXT_LEN)
        if args[0] == "bench":  # small settings: plan quality of every strategy on the demo data
            args += ["--scenario", "quality", "--cp", "4"]
        outputs.append(flashcp(args, env, tmp_path))
    pack, plan_flashcp, plan_default, verify, show, bench = (o.stdout + o.stderr for o in outputs)
    assert "packed" in pack
    assert "compiling planner kernels, first run only" in plan_flashcp
    assert "cp8-flashcp/" in plan_flashcp and "all validated" in plan_flashcp
    assert "cp8-flashcp2/" in plan_default and "all validated" in plan_default
    assert "ok" in verify and "problem" not in verify
    assert "plan cp8-flashcp2" in show
    for name in ("flashcp2", "flashcp", "flashcp+", "llama3", "perdoc", "ring", "magi", "ptrr"):
        assert name in bench


def test_the_default_first_then_algorithm_1_and_a_peer(tmp_path):
    """The README's order reversed: flashcp2 compiled first, then strategies it links in part."""
    data = tmp_path / "data"
    env = fresh_env(tmp_path / "numba-cache")
    flashcp(["synth", str(data), "--dist", "wlb", "--num-seqs", "6", "--context-len", str(CONTEXT_LEN),
             "--no-tokens"], env, tmp_path)
    for strategy in ("flashcp2", "flashcp", "magi"):
        flashcp(["plan", str(data), "--cp", "8", "--strategy", strategy], env, tmp_path)
    verify = flashcp(["verify", str(data), "--json"], env, tmp_path)
    assert '"ok": true' in verify.stdout
    assert all(f'"cp8-{s}": 6' in verify.stdout for s in ("flashcp2", "flashcp", "magi"))
