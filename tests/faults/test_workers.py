"""The fault suite, worker processes of ``plan --workers``: a worker killed, and the main process killed.

A dead worker is one sentence, exit 1, nothing written; the workers of a killed main process die with it and
hold none of its locks, so the next ``plan`` and ``pack --force`` run.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import flashcp.planner.pipeline as pipeline
from tests.faults.workspace import ROOT, docs, pack_args, run, tree, unchanged, write_jsonl


@pytest.fixture
def ws(tmp_path):
    """A dataset of 3 data files with a plan, and its input."""
    write_jsonl(tmp_path / "in.jsonl", docs(40))
    assert run(*pack_args(tmp_path / "in.jsonl", tmp_path / "data")).exit_code == 0
    assert len(list((tmp_path / "data" / "data").iterdir())) >= 3
    assert run("plan", tmp_path / "data", "--cp", 2, "--strategy", "flashcp").exit_code == 0
    return tmp_path


def test_a_killed_worker_is_one_sentence(ws, monkeypatch):
    """Case 12: one worker SIGKILLed while it plans: exit 1, one sentence, the tree byte-identical."""
    real = pipeline.plan_data_file

    @functools.wraps(real)  # pickled by name: the forked workers find this one
    def dies_on_the_second_file(job):
        if job.file_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(job)

    monkeypatch.setattr(pipeline, "plan_data_file", dies_on_the_second_file)
    for extra in (["--force"], ["--name", "other"]):
        unchanged(ws, ["plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--workers", 2, *extra],
                  "a planning worker process died")


MAIN = """
import functools, os, sys, time
import flashcp.planner.pipeline as pipeline
real = pipeline.plan_data_file
@functools.wraps(real)
def stalls(job):
    open(os.path.join(os.environ["PID_DIR"], str(os.getpid())), "w").close()
    time.sleep(600)
pipeline.plan_data_file = stalls
from flashcp.cli import cli
cli(sys.argv[1:], prog_name="flashcp")
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_killed_main_process(ws, tmp_path):
    """Case 9: ``plan --workers 2`` SIGKILLed while both workers plan: they die too, and no lock is left."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PID_DIR": str(pids), "PYTHONPATH": str(ROOT)}
    main = subprocess.Popen([sys.executable, "-c", MAIN, "plan", str(ws / "data"), "--cp", "2", "--strategy",
                             "flashcp", "--workers", "2", "--force"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2, "the workers did not start"
        main.kill()
        main.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers), "a worker outlived its main process"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    result = run("plan", ws / "data", "--cp", 2, "--strategy", "flashcp", "--force")
    assert result.exit_code == 0 and "removed 1 staging folder(s)" in result.stderr, result.output
    result = run(*pack_args(ws / "in.jsonl", ws / "data", "--force"))
    assert result.exit_code == 0, result.output
    assert "plans" not in tree(ws / "data")
