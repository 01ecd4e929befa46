"""``--engine ray``: the same bytes as the local engine, through lost workers and a killed driver."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from flashcp.data.pack_output import OutputFolder
from flashcp.data.packing import OVERFLOWS, PackCounts, Packer
from tests.cli.pack_helpers import file_hashes
from tests.engines.corpus import make_corpus, pack_args, run

ray = pytest.importorskip("ray")
import flashcp.engines.ray_pack as ray_pack  # noqa: E402  (with ray installed, an import failure is a failure)

ROOT = Path(__file__).resolve().parents[2]
def _untimed(output: str, out: Path) -> str:
    return re.sub(r" in [0-9.]+ s \([0-9,]+ tokens/s\)", "", output.replace(str(out), "OUT"))


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray with 2 worker CPUs for the whole module (start-up is the main cost)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(ray_pack, "SHARD_BYTES", 40_000)  # a dozen tokenize tasks over the corpus


# ---- byte for byte ----

@pytest.mark.parametrize("extra", [(), ("--overflow", "truncate", "--no-eos")])
def test_ray_pack_equals_local_pack(tmp_path, local_ray, small_shards, monkeypatch, extra):
    states: dict[str, list] = {"local": [], "ray": []}
    original = OutputFolder.write_state

    def write_state(self, *args):  # every resume point and counter snapshot each engine records
        states[self.root.name].append([part.to_json() for part in self.parts])
        original(self, *args)

    monkeypatch.setattr(OutputFolder, "write_state", write_state)
    inputs = make_corpus(tmp_path / "in")
    args = pack_args(inputs, 1024, "--tokenizer", "byte", *extra)
    local = run("pack", *args, "-o", tmp_path / "local", "--workers", "1")
    assert local.exit_code == 0, local.output
    result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray")
    assert result.exit_code == 0, result.output
    assert len(states["local"]) > 10 and states["ray"] == states["local"]
    assert _untimed(result.output, tmp_path / "ray") == _untimed(local.output, tmp_path / "local")
    hashes = file_hashes(tmp_path / "ray")
    assert len(hashes) > 10 and hashes == file_hashes(tmp_path / "local")
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["records_skipped_total"] > 10 and counts["documents_dropped_empty"] > 0
    assert all(counts["records_skipped"].values()) and counts["inputs_empty"] == 1
    assert counts["documents_split" if not extra else "documents_truncated"] > 10
    assert "skipped" in result.output and "resumed" not in result.output


def test_progress_counts_every_sequence(tmp_path, local_ray, small_shards):
    from flashcp.data.pack import PackConfig, run_pack
    from flashcp.engines.ray_pack import RayPackEngine

    config = PackConfig(inputs=tuple(map(str, make_corpus(tmp_path / "in"))), output=tmp_path / "out",
                        context_len=512, tokenizer="byte", rows_per_file=7)
    told: list[int] = []
    result = run_pack(config, on_rows=told.append, engine=RayPackEngine())
    assert len(told) > 5 and sum(told) == result.manifest["num_sequences"]


def test_strict_stops_at_the_same_record(tmp_path, local_ray, small_shards):
    inputs = make_corpus(tmp_path / "in")
    args = pack_args(inputs, 1024, "--tokenizer", "byte", "--strict")
    local = run("pack", *args, "-o", tmp_path / "local")
    result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray")
    assert local.exit_code == result.exit_code == 1
    assert "web-0.jsonl line 6 is not a JSON object" in result.output
    assert result.output == local.output
    assert not (tmp_path / "ray").exists()


def test_an_unreadable_input_fails_with_the_local_sentence(tmp_path, local_ray, small_shards):
    inputs = make_corpus(tmp_path / "in")
    (tmp_path / "in" / "broken.jsonl.gz").write_bytes(b"not gzip at all\n")
    args = pack_args([*inputs, tmp_path / "in" / "broken.jsonl.gz"], 1024, "--tokenizer", "byte")
    local = run("pack", *args, "-o", tmp_path / "local")
    result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray")
    assert local.exit_code == result.exit_code == 1
    assert "broken.jsonl.gz is not a readable gzip file" in result.output and result.output == local.output
    assert not (tmp_path / "ray").exists()


@pytest.mark.parametrize("changed", ["web-1.jsonl", "table.parquet"])  # read in byte ranges, in row groups
def test_an_input_changed_under_the_pack_is_refused_alike(tmp_path, local_ray, small_shards, monkeypatch,
                                                          changed):
    """Fault suite, both engines: an input replaced after pack hashed it is refused with the same sentence."""
    import flashcp.data.pack as pack_module

    inputs = make_corpus(tmp_path / "in")
    args = pack_args(inputs, 1024, "--tokenizer", "byte")
    real = pack_module.prepare_output

    def prepare(*a, **k):  # after hashing, before reading: the input is replaced by a copy of itself
        path = tmp_path / "in" / changed
        (tmp_path / "copy").write_bytes(path.read_bytes())
        os.replace(tmp_path / "copy", path)
        return real(*a, **k)

    monkeypatch.setattr(pack_module, "prepare_output", prepare)
    local = run("pack", *args, "-o", tmp_path / "local")
    result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray")
    assert local.exit_code == result.exit_code == 1 and result.output == local.output
    assert f"input {tmp_path / 'in' / changed} changed while flashcp pack was reading it" in result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "ray").exists() and not (tmp_path / "local").exists()


def _first_run_waits(task: str, folder: Path):
    """A stand-in for ``ray_pack.<task>``: the first run anywhere (claimed through a file in ``folder``) writes its
    worker's PID to ``folder/pid`` and waits to be killed, a write task after its first row group (its data file
    half written); every other run, Ray's re-run of the killed one included, is the real task."""

    def wait_to_be_killed() -> None:
        (folder / "pid.tmp").write_text(str(os.getpid()))
        os.replace(folder / "pid.tmp", folder / "pid")
        time.sleep(120)
        raise RuntimeError(f"the {task} task was not killed")

    def run(*args):
        import flashcp.engines.ray_pack as module  # in the worker: the real tasks

        try:
            os.close(os.open(folder / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return getattr(module, task)(*args)
        if task == "_tokenize_shard":
            wait_to_be_killed()
        write_group = module._write_group

        def write_group_then_wait(*group_args):
            write_group(*group_args)
            wait_to_be_killed()

        module._write_group = write_group_then_wait  # this worker dies with it
        return module._write_part(*args)

    return run


def _kill_when_waiting(folder: Path, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the worker whose PID the waiting task wrote to ``folder/pid``."""
    while not stop.is_set():
        if (folder / "pid").exists():
            pid = int((folder / "pid").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        stop.wait(0.01)


@pytest.mark.parametrize("task", ["_tokenize_shard", "_write_part"])
def test_a_worker_killed_mid_task_changes_nothing(tmp_path, local_ray, monkeypatch, task):
    monkeypatch.setattr(ray_pack, "SHARD_BYTES", 100_000)
    inputs = make_corpus(tmp_path / "in", scale=2, seed=3)
    args = [*map(str, inputs), "--context-len", "4096", "--rows-per-file", "8", "--row-group-rows", "4"]
    local = run("pack", *args, "-o", tmp_path / "local", "--workers", "1")  # the deepseek-v3 tokenizer
    assert local.exit_code == 0, local.output
    signals = tmp_path / "signals"
    signals.mkdir()
    monkeypatch.setattr(ray_pack, task, _first_run_waits(task, signals))  # the driver submits the stand-in
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_when_waiting, args=(signals, stop, killed), daemon=True)
    watcher.start()
    try:
        result = run("pack", *args, "-o", tmp_path / "ray", "--engine", "ray")
    finally:
        stop.set()
        watcher.join()
    assert result.exit_code == 0, result.output
    assert killed == [int((signals / "pid").read_text())], f"no {task} task was killed"
    assert killed[0] != os.getpid()  # a Ray worker, not the driver
    assert file_hashes(tmp_path / "ray") == file_hashes(tmp_path / "local")


KILLER = """
import os, signal, sys
from flashcp.data.pack_output import OutputFolder
import flashcp.engines.ray_pack as ray_pack
ray_pack.SHARD_BYTES = 40_000
original, calls = OutputFolder.write_state, [0]
def write_state(self, *args):
    original(self, *args)
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT_STATE"]):
        os.kill(os.getpid(), signal.SIGKILL)
OutputFolder.write_state = write_state
from flashcp.cli import cli
cli(sys.argv[1:], prog_name="flashcp")
"""


def test_a_killed_driver_resumes_to_the_same_bytes(tmp_path, local_ray, small_shards):
    inputs = make_corpus(tmp_path / "in")
    args = pack_args(inputs, 1000, "--tokenizer", "byte")
    assert run("pack", *args, "-o", tmp_path / "local", "--workers", "1").exit_code == 0
    out = tmp_path / "ray"
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "KILL_AT_STATE": "6", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLER, "pack", *args, "-o", str(out), "--engine", "ray",
                             "--ray-address", address], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -9, killed.stderr
    state = json.loads((out / "pack-state.json").read_text())
    assert not (out / "manifest.json").exists() and len(state["parts"]) == 5
    assert any(part["resume"]["offset"] > 0 for part in state["parts"])  # a part ends mid-document

    result = run("-v", "pack", *args, "-o", out, "--engine", "ray")
    assert result.exit_code == 0, result.output
    assert "resumed an interrupted pack after 5 finished data file(s)" in result.output
    assert file_hashes(out) == file_hashes(tmp_path / "local")


def test_plan_on_ray_equals_local_plan(tmp_path, local_ray):
    inputs = make_corpus(tmp_path / "in")
    data = tmp_path / "data"
    assert run("pack", *map(str, inputs), "-o", data, "--context-len", "2048", "--tokenizer", "byte",
               "--rows-per-file", "40").exit_code == 0
    assert run("plan", data, "--cp", "4", "--name", "local").exit_code == 0
    result = run("plan", data, "--cp", "4", "--name", "ray", "--engine", "ray")
    assert result.exit_code == 0, result.output
    local, distributed = file_hashes(data / "plans" / "local"), file_hashes(data / "plans" / "ray")
    assert len(local) >= 4
    plan_json = {k: v for k, v in json.loads((data / "plans" / "ray" / "plan.json").read_text()).items()
                 if k != "name"}
    assert plan_json == {k: v for k, v in json.loads((data / "plans" / "local" / "plan.json").read_text()).items()
                         if k != "name"}
    local.pop("plan.json"), distributed.pop("plan.json")
    assert distributed == local


@pytest.mark.parametrize("overflow", OVERFLOWS)
def test_layout_kernel_equals_the_lengths_only_packer(overflow):
    from flashcp.engines._layout import lay_out

    rng = np.random.default_rng(1)
    for context_len in (1, 5, 64):
        reference = Packer(context_len, overflow, PackCounts(documents_truncated=2), lengths_only=True)
        state = np.array([0, 0, 0, 2, 0], np.int64)
        for _ in range(20):  # shard after shard, the state carried over
            lens = rng.choice([1, 2, context_len, context_len + 1, 4 * context_len, 70], rng.integers(0, 30))
            starts = np.where(rng.random(lens.size) < 0.1, rng.integers(0, lens), 0).astype(np.int64)
            windows = lay_out(lens.astype(np.int64), starts, context_len, overflow == "truncate", state)
            expected = [(i, w.resume_offset, w.counts.to_json())
                        for i, (n, start) in enumerate(zip(lens.tolist(), starts.tolist()))
                        for w in reference.add_length(n, start)]
            assert [(int(w[0]), int(w[1]), {"documents_split": int(w[2]), "documents_truncated": int(w[3]),
                                            "tokens_truncated": int(w[4])}) for w in windows] == expected
            assert (int(state[0]), int(state[1])) == reference.tail()


def test_a_local_pack_killed_midway_resumes_on_ray(tmp_path, local_ray, small_shards):
    from tests.cli.pack_helpers import KILLER as LOCAL_KILLER

    inputs = make_corpus(tmp_path / "in", seed=7)
    args = pack_args(inputs, 1000, "--tokenizer", "byte", "--workers", "1")
    assert run("pack", *args, "-o", tmp_path / "local").exit_code == 0
    out = tmp_path / "out"
    env = {**os.environ, "KILL_AT_GROUP": "9", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", LOCAL_KILLER, "pack", *args, "-o", str(out)], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert len(json.loads((out / "pack-state.json").read_text())["parts"]) == 4
    result = run("-v", "pack", *args, "-o", out, "--engine", "ray")
    assert result.exit_code == 0, result.output
    assert "resumed an interrupted pack after 4 finished data file(s)" in result.output
    assert file_hashes(out) == file_hashes(tmp_path / "local")
