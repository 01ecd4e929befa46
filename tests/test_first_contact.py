"""First contact: the README's main job from an empty Numba cache, every command in a process of its own.

A suite that compiles the planner's kernels in one process cannot see what a second process loads from the
on-disk cache: machine code cached by ``plan --strategy flashcp`` once made the next ``plan`` (flashcp2)
reject every plan it made (``flashcp._numba`` says why). These tests run flashcp as a new user does: each
command a fresh process, the cache empty before the first. Every plan of every step is validated by the
command itself and again by ``verify``. ``scripts/cache_pairs.py`` runs every ordered pair of strategies the
same way (too long for CI). The two orders run at once, and the README's compiles into the suite's
cache (``tests/conftest.py``), which every later test then loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tests.readme import readme_main_job

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONTEXT_LEN = 8192
"""The tests' context length (the README's is 131072; the kernels compiled are the same)."""


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


def compiled_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.suffix in (".nbi", ".nbc")] if cache.is_dir() else []


def readme_chain(tmp: Path, cache: Path) -> list[str]:
    """The README's main job on a small corpus, each command a process; the output of each."""
    corpus = small_corpus(tmp / "corpus")
    env = fresh_env(cache)
    outputs = []
    for step in readme_main_job():
        args = [str(corpus) if a == "$S" else a for a in step]
        if "--context-len" in args:
            args[args.index("--context-len") + 1] = str(CONTEXT_LEN)
        if args[0] == "bench":  # --quick on small settings (those of tests/cli/test_bench.py's smoke test)
            args += ["--dist", "wlb,pile", "--context-len", "16384", "--seqs", "2", "--cp", "2,4", "--heads", "8",
                     "--runtime-context-len", "256", "--runtime-cp", "2"]
        done = flashcp(args, env, tmp)
        outputs.append(done.stdout + done.stderr)
    return outputs


def reverse_chain(tmp: Path, cache: Path) -> str:
    """The README's order reversed: flashcp2 compiled first, then strategies it links in part; verify's JSON."""
    data = tmp / "data"
    env = fresh_env(cache)
    flashcp(["synth", str(data), "--dist", "wlb", "--num-seqs", "6", "--context-len", str(CONTEXT_LEN),
             "--no-tokens"], env, tmp)
    for strategy in ("flashcp2", "flashcp", "magi"):
        flashcp(["plan", str(data), "--cp", "8", "--strategy", strategy], env, tmp)
    return flashcp(["verify", str(data), "--json"], env, tmp).stdout


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Both orders at once (each compile is one core's work), each from an empty cache.

    The README's order compiles into the suite's own cache (``tests/conftest.py``), still empty (this module
    runs first and collecting the suite compiles nothing), so the tests after it load what these processes
    compiled; with a kept cache (``FLASHCP_TEST_NUMBA_CACHE``) it takes a folder of its own. The reverse
    order always has its own.
    """
    if os.environ.get("FLASHCP_TEST_NUMBA_CACHE"):
        readme_cache = tmp_path_factory.mktemp("cache-readme")
    else:
        readme_cache = Path(os.environ["NUMBA_CACHE_DIR"])
        assert not compiled_files(readme_cache), "a kernel was compiled before the first-contact tests ran " \
            "(while collecting?): the suite's cache is no longer empty"
    reverse_cache = tmp_path_factory.mktemp("cache-reverse")
    with ThreadPoolExecutor(2) as pool:
        readme = pool.submit(readme_chain, tmp_path_factory.mktemp("readme"), readme_cache)
        reverse = pool.submit(reverse_chain, tmp_path_factory.mktemp("reverse"), reverse_cache)
        wait([readme, reverse])
    return readme, reverse


def test_the_readme_main_job_runs_from_an_empty_cache(chains):
    assert [s[0] for s in readme_main_job()] == ["pack", "plan", "plan", "verify", "show", "bench"]
    pack, plan_flashcp, plan_default, verify, show, bench = chains[0].result()
    assert "packed" in pack
    assert "compiling planner kernels, first run only" in plan_flashcp
    assert "cp8-flashcp/" in plan_flashcp and "all validated" in plan_flashcp
    assert "cp8-flashcp2/" in plan_default and "all validated" in plan_default
    assert "ok" in verify and "problem" not in verify
    assert "plan cp8-flashcp2" in show
    for name in ("flashcp2", "flashcp", "flashcp+", "llama3", "perdoc", "ring", "magi", "ptrr"):
        assert name in bench


def test_the_default_first_then_algorithm_1_and_a_peer(chains):
    verify = chains[1].result()
    assert '"ok": true' in verify
    assert all(f'"cp8-{s}": 6' in verify for s in ("flashcp2", "flashcp", "magi"))
